{{- define "embedfleet.name" -}}embedfleet-operator{{- end -}}

{{- define "embedfleet.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "embedfleet.labels" -}}
app.kubernetes.io/name: {{ include "embedfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "embedfleet.selector" -}}
app.kubernetes.io/name: {{ include "embedfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "embedfleet.serviceAccountName" -}}
{{- default (include "embedfleet.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

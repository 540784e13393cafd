{{- define "embedfleet.name" -}}embedfleet-operator{{- end -}}

{{- define "embedfleet.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "embedfleet.common" -}}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "embedfleet.labels" -}}
{{ include "embedfleet.selector" . }}
{{ include "embedfleet.common" . }}
{{- end -}}

{{- define "embedfleet.selector" -}}
app.kubernetes.io/name: {{ include "embedfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /* The selector labels as `k=v,k=v` (EMBEDOP_POD_LABELS): the operator's pods as a service's
NetworkPolicy admits them to the servers' metrics port. The selector's, not every label: they are
the same on every operator pod, across upgrades (app.kubernetes.io/version is not). */ -}}
{{- define "embedfleet.selectorPairs" -}}
{{- $pairs := list -}}
{{- range $k, $v := include "embedfleet.selector" . | fromYaml -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{- /* The uninstall hook's objects and pod: labels of their own, so nothing that selects the
operator (its Deployment, a PodMonitor, kubectl logs -l) takes the hook's pod for one of its. */ -}}
{{- define "embedfleet.uninstall.selector" -}}
app.kubernetes.io/name: embedfleet-uninstall
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: uninstall
{{- end -}}

{{- define "embedfleet.uninstall.labels" -}}
{{ include "embedfleet.uninstall.selector" . }}
{{ include "embedfleet.common" . }}
{{- end -}}

{{- define "embedfleet.serviceAccountName" -}}
{{- default (include "embedfleet.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

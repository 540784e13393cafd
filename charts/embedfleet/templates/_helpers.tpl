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

{{- /* Cluster-scoped objects of the release (the scope ClusterRole, the admission policy), called
with (list . "<what>"): <fullname>-<what>.<namespace>, so that releases of one name in two
namespaces do not collide. The namespace after the last dot: a namespace has none, so no two
(release, namespace) pairs give one name (<namespace>-<fullname> did: namespace a-b with release c,
namespace a with release b-c). */ -}}
{{- define "embedfleet.clusterName" -}}
{{- $ctx := index . 0 -}}
{{- printf "%s-%s.%s" (include "embedfleet.fullname" $ctx) (index . 1) $ctx.Release.Namespace | trimSuffix "." -}}
{{- end -}}

{{- /* The leader-election Lease's name (EMBEDOP_LEASE_NAME, and the leader Role's resourceNames).
leaseName when given; else the name the release's operator already uses, read from its live
Deployment (lookup): renaming it during a rollout would let the old pod and the new one each hold
a Lease of its own and both act. A release from before this setting used the operator's default,
embedop-leader, which every such release of the namespace shared, and the one not holding it never
led: it keeps embedop-leader only while embedop-leader is held by one of its own pods (or by no
live pod: nobody acts on it, and its old pod may take it during the rollout); held by another
release's pod, it takes a Lease of its own, on which its new pod leads at once (its old pod, never
the holder, goes on waiting). Else (a new release, or a render without a cluster: helm template,
lint, a client-side --dry-run, Argo CD: lookup finds nothing) a Lease of the release's own,
<fullname>-leader, so that two releases in one namespace never share one. */ -}}
{{- define "embedfleet.leaseName" -}}
{{- if .Values.leaseName -}}
{{- .Values.leaseName -}}
{{- else -}}
{{- $own := printf "%s-leader" (include "embedfleet.fullname" .) -}}
{{- $live := lookup "apps/v1" "Deployment" .Release.Namespace (include "embedfleet.fullname" .) -}}
{{- if $live -}}
{{- $name := "" -}}
{{- range (($live.spec).template.spec).containers | default list -}}
{{- if eq .name "operator" -}}
{{- range .env | default list -}}
{{- if and (eq .name "EMBEDOP_LEASE_NAME") .value -}}{{- $name = .value -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not $name -}}
{{- $name = "embedop-leader" -}}
{{- $holder := ((lookup "coordination.k8s.io/v1" "Lease" .Release.Namespace $name).spec).holderIdentity | default "" -}}
{{- /* The holder's identity is its pod's name and a random suffix (operator config, identity). */ -}}
{{- $pod := dict -}}
{{- if $holder -}}{{- $pod = lookup "v1" "Pod" .Release.Namespace (regexReplaceAll "_[0-9a-f]+$" $holder "") -}}{{- end -}}
{{- if $pod -}}
{{- $labels := ($pod.metadata).labels | default dict -}}
{{- range $k, $v := include "embedfleet.selector" . | fromYaml -}}
{{- if ne (toString (get $labels $k)) (toString $v) -}}{{- $name = $own -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $name -}}
{{- else -}}
{{- $own -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* The release's claim on the namespaces its operator watches (scope-claim.yaml). */ -}}
{{- define "embedfleet.scopeClaimName" -}}
{{- printf "%s-scope" (include "embedfleet.fullname" .) -}}
{{- end -}}

{{- /* Whether the cluster serves ValidatingAdmissionPolicy in admissionregistration.k8s.io/v1
(Kubernetes 1.30+): the kind, as a live cluster's discovery lists it; or, where the version set
names groups only (helm template's built-in one), the group version and a KubeVersion of 1.30 or
later. "true" or "". */ -}}
{{- define "embedfleet.hasAdmissionPolicy" -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" -}}
true
{{- else if and (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1") (semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version) -}}
true
{{- end -}}
{{- end -}}

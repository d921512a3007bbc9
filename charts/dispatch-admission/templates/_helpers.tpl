{{- define "dispatch-admission.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dispatch-admission.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dispatch-admission.labels" -}}
app.kubernetes.io/name: {{ include "dispatch-admission.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dispatch-admission.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dispatch-admission.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dispatch-admission.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dispatch-admission.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "dispatch-admission.secretName" -}}
{{- default (printf "%s-tls" (include "dispatch-admission.fullname" .)) .Values.certificates.secretName -}}
{{- end -}}

{{- define "dispatch-admission.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The settings document (SPEC 2), from the values. */}}
{{- define "dispatch-admission.settings" -}}
{{- $s := dict "manager" .Values.manager -}}
{{- if .Values.publish.image -}}
{{- $p := dict "image" .Values.publish.image "via" (default "imageVolume" .Values.publish.via) -}}
{{- if .Values.publish.initContainer -}}
{{- $_ := set $p "initContainer" .Values.publish.initContainer -}}
{{- end -}}
{{- $_ := set $s "publish" $p -}}
{{- end -}}
{{- if .Values.credentials -}}
{{- $_ := set $s "credentials" .Values.credentials -}}
{{- end -}}
{{- toPrettyJson $s -}}
{{- end -}}

{{/* One webhook's shared fields: rules, selectors, client config. Args: dict "root" . "path" "/mutate" */}}
{{- define "dispatch-admission.webhookCommon" -}}
{{- $root := .root -}}
admissionReviewVersions: ["v1"]
sideEffects: None
timeoutSeconds: {{ $root.Values.webhook.timeoutSeconds }}
matchPolicy: Equivalent
rules:
  - apiGroups: ["trainer.kubeflow.org"]
    apiVersions: ["v1alpha1"]
    resources: ["trainjobs"]
    operations: ["CREATE", "UPDATE"]
    scope: "*"
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: NotIn
      values:
        {{- toYaml (concat (list "kube-system" $root.Release.Namespace) $root.Values.webhook.excludeNamespaces | uniq) | nindent 8 }}
{{- with $root.Values.webhook.objectSelector }}
objectSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
clientConfig:
{{- if $root.Values.webhook.url }}
  url: {{ printf "%s%s" (trimSuffix "/" $root.Values.webhook.url) .path | quote }}
{{- else }}
  service:
    name: {{ include "dispatch-admission.fullname" $root }}
    namespace: {{ $root.Release.Namespace }}
    path: {{ .path }}
    port: {{ $root.Values.service.port }}
{{- end }}
{{- with $root.Values.webhook.caBundle }}
  caBundle: {{ . }}
{{- end }}
{{- end -}}

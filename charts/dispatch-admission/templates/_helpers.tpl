{{- define "dispatch-admission.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's object names. Kept to 52 characters: "-runtimes", "-pre-delete" and "-test" are appended. */}}
{{- define "dispatch-admission.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dispatch-admission.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object. Args: dict "root" . "component" "webhook" */}}
{{- define "dispatch-admission.componentLabels" -}}
{{ include "dispatch-admission.selectorLabels" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: dispatch
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ include "dispatch-admission.chart" .root }}
{{- end -}}

{{- define "dispatch-admission.labels" -}}
{{ include "dispatch-admission.componentLabels" (dict "root" . "component" "webhook") }}
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

{{- define "dispatch-admission.runtimesConfigurationName" -}}
{{- printf "%s-runtimes" (include "dispatch-admission.fullname" .) -}}
{{- end -}}

{{/* The webhook's own image. No default repository: a placeholder would install a fail-closed webhook
whose pods never start, refusing every TrainJob in the cluster. */}}
{{- define "dispatch-admission.image" -}}
{{- $repo := required "image.repository is required: the dispatch-admission image to run, built from the project's Dockerfile and pushed to a registry your nodes pull from (for example --set image.repository=registry.example.com/dispatch-admission --set image.digest=sha256:...)" .Values.image.repository -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repo .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) -}}
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

{{/* Where the API server's client-certificate CA is mounted, when one is configured. */}}
{{- define "dispatch-admission.clientCAConfigMap" -}}
{{- if .Values.clientCA.existingConfigMap -}}
{{- .Values.clientCA.existingConfigMap -}}
{{- else if .Values.clientCA.pem -}}
{{- printf "%s-client-ca" (include "dispatch-admission.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The namespaces never sent to the webhooks. */}}
{{- define "dispatch-admission.namespaceSelector" -}}
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: NotIn
      values:
        {{- toYaml (concat (list "kube-system" .Release.Namespace) .Values.webhook.excludeNamespaces | uniq) | nindent 8 }}
    {{- with .Values.webhook.ignoreNamespaceLabel }}
    - key: {{ . }}
      operator: DoesNotExist
    {{- end }}
{{- end -}}

{{/* One webhook's client config. Args: dict "root" . "path" "/mutate" */}}
{{- define "dispatch-admission.clientConfig" -}}
{{- $root := .root -}}
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

{{/* A TrainJob webhook's shared fields: rules, selectors, client config. Args: dict "root" . "path" "/mutate" */}}
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
{{ include "dispatch-admission.namespaceSelector" $root }}
# An update of a TrainJob being deleted (its finalizers removed) is never sent: the webhook would allow it
# anyway, and so it goes through while no replica answers.
matchConditions:
  - name: not-being-deleted
    expression: "!has(object.metadata.deletionTimestamp)"
{{- with $root.Values.webhook.objectSelector }}
objectSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{ include "dispatch-admission.clientConfig" . }}
{{- end -}}

{{/* Annotations of a webhook configuration (cert-manager's CA injection). */}}
{{- define "dispatch-admission.webhookAnnotations" -}}
{{- if .Values.certificates.certManager.enabled -}}
annotations:
  cert-manager.io/inject-ca-from: {{ .Release.Namespace }}/{{ include "dispatch-admission.fullname" . }}
{{- end }}
{{- end -}}

{{/* The label matchers that select this release's series in PromQL. */}}
{{- define "dispatch-admission.seriesSelector" -}}
{{- default (printf "job=%q,namespace=%q" (include "dispatch-admission.fullname" .) .Release.Namespace) .Values.prometheusRule.selector -}}
{{- end -}}

{{/* The restricted pod and container security contexts, shared by the webhook and the hook pods. */}}
{{- define "dispatch-admission.podSecurityContext" -}}
{{- with .Values.podSecurityContext -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "dispatch-admission.containerSecurityContext" -}}
{{- with .Values.containerSecurityContext -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Labels of hook objects (helm test, pre-delete). Their app.kubernetes.io/name differs from the webhook's,
so the Service, the PDB and the ReplicaSet never select (or adopt) a hook pod. Args: dict "root" . "component" "test" */}}
{{- define "dispatch-admission.hookLabels" -}}
app.kubernetes.io/name: {{ printf "%s-%s" (include "dispatch-admission.name" .root) .component | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: dispatch
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ include "dispatch-admission.chart" .root }}
{{- end -}}

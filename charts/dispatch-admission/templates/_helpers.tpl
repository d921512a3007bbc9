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

{{/* The certificate controller's ServiceAccount: one of its own, never the webhook's nor the namespace's default
(it may create Secrets and patch the webhook configurations; every pod running as that account would inherit it). */}}
{{- define "dispatch-admission.certificatesServiceAccountName" -}}
{{- $sa := .Values.certificates.controller.serviceAccount -}}
{{- $name := "" -}}
{{- if $sa.create -}}
{{- $name = default (printf "%s-certs" (include "dispatch-admission.fullname" .)) $sa.name -}}
{{- else -}}
{{- $name = required "certificates.controller.serviceAccount.name is required when certificates.controller.serviceAccount.create is false: an existing ServiceAccount of the certificate controller's own" $sa.name -}}
{{- end -}}
{{- if eq $name (include "dispatch-admission.serviceAccountName" .) -}}
{{- fail (printf "the certificate controller and the webhook would both run as ServiceAccount %s: give the controller its own (certificates.controller.serviceAccount), or the serving pods get its rights to write Secrets and patch the webhook configurations" $name) -}}
{{- end -}}
{{- if eq $name "default" -}}
{{- fail "certificates.controller.serviceAccount.name must not be default: every pod of the namespace runs as it and would get the controller's rights to write Secrets and patch the webhook configurations" -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* The Secret holding the self-managed CA's certificate and key: read by the certificate controller only. */}}
{{- define "dispatch-admission.caSecretName" -}}
{{- printf "%s-ca" (include "dispatch-admission.fullname" .) -}}
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

{{/* The repositories the settings may name for the publish image (serve --publish-repositories), comma-separated:
publish.repositories, else the repository of publish.image (none without one). */}}
{{- define "dispatch-admission.publishRepositories" -}}
{{- $repos := .Values.publish.repositories -}}
{{- $own := "" -}}
{{- if .Values.publish.image -}}
{{- $own = first (splitList "@" .Values.publish.image) -}}
{{- end -}}
{{- if not $repos -}}
{{- $repos = compact (list $own) -}}
{{- else if and $own (not (has $own $repos)) -}}
{{- fail (printf "publish.image's repository %s is not in publish.repositories (%s): the webhook would refuse its own settings" $own (join ", " $repos)) -}}
{{- end -}}
{{- join "," $repos -}}
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
# anyway, and so it goes through while no replica answers. Judged on the stored object (oldObject) and on
# UPDATE only: a CREATE may carry a deletionTimestamp of its own (an API server that clears it only in
# BeforeCreate, after mutating admission, would show it to the condition), and must never skip the webhooks.
matchConditions:
  - name: not-being-deleted
    expression: "request.operation != 'UPDATE' || !has(oldObject.metadata.deletionTimestamp)"
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

{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "rlhf-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: fullnameOverride, else the release name when it already holds the chart name, else <release>-<chart>. */}}
{{- define "rlhf-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels that select the operator pods (stable across upgrades). */}}
{{- define "rlhf-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlhf-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of every object of the chart. */}}
{{- define "rlhf-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rlhf-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rlhf-operator
{{- end }}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "rlhf-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rlhf-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image reference: repository:tag, and @digest when image.digest is set
(the runtime pulls by the digest; the tag tells a reader which release it is). */}}
{{- define "rlhf-operator.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $ref .Values.image.digest }}
{{- else }}
{{- $ref }}
{{- end }}
{{- end }}

{{/* The leader Lease: leaderElection.leaseName, or the release's full name (one per release). */}}
{{- define "rlhf-operator.leaseName" -}}
{{- .Values.leaderElection.leaseName | default (include "rlhf-operator.fullname" .) -}}
{{- end }}

{{/* Labels of the `helm test` objects: not the operator's selector labels, so that no
Deployment, Service or PodDisruptionBudget of the chart selects the test pod. */}}
{{- define "rlhf-operator.testLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "rlhf-operator.name" . }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: helm-test
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rlhf-operator
{{- end }}

{{/* The trainer image of the ClusterTrainingRuntime rlhf-torch (each TrainJob names its own). */}}
{{- define "rlhf-operator.trainerImage" -}}
{{- printf "%s:%s" .Values.trainingRuntime.image.repository (default .Chart.AppVersion .Values.trainingRuntime.image.tag) }}
{{- end }}

{{/* The operator's namespaced rights (rbac.yaml: a ClusterRole, or a Role in each watched
namespace): RLHFJobs, their status, their children, Events. */}}
{{- define "rlhf-operator.operatorRules" }}
rules:
  - apiGroups: [rlhf.dev]
    resources: [rlhfjobs]
    verbs: [get, list, watch, patch, delete]
  - apiGroups: [rlhf.dev]
    resources: [rlhfjobs/status]
    verbs: [get, patch]
  - apiGroups: [""]
    resources: [pods]
    # delete: force-delete the pods of a lost node (grace 0); patch: label a TrainJob's pods as the job's
    verbs: [get, list, watch, patch, delete]
  - apiGroups: [""]
    resources: [persistentvolumeclaims]
    # read a job's output.claimName's accessModes: ReadWriteMany lets its rollout pods share the trainer's downloads
    verbs: [get]
  - apiGroups: [""]
    resources: [configmaps, services, serviceaccounts]
    verbs: [get, create, patch, delete]
  - apiGroups: [""]
    resources: [events]
    verbs: [create, patch]
  - apiGroups: [events.k8s.io]
    resources: [events]
    verbs: [create, patch]
  - apiGroups: [apps]
    resources: [statefulsets]
    verbs: [get, list, watch, create, patch, delete]
  - apiGroups: [kubeflow.org]
    resources: [pytorchjobs]
    verbs: [get, list, watch, create, patch, delete]
  - apiGroups: [jobset.x-k8s.io]
    resources: [jobsets]
    verbs: [get, list, watch, create, patch, delete]
  - apiGroups: [trainer.kubeflow.org]
    resources: [trainjobs]
    verbs: [get, list, watch, create, patch, delete]
  - apiGroups: [leaderworkerset.x-k8s.io]
    # rollout.nodesPerServer > 1: multi-node rollout servers (optional, as JobSet)
    resources: [leaderworkersets]
    verbs: [get, list, watch, create, patch, delete]
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [get, create, patch, delete]
  - apiGroups: [rbac.authorization.k8s.io]
    resources: [roles, rolebindings]
    verbs: [get, create, patch, delete]
{{- end }}

{{/*
Names. Kubernetes names and label values are at most 63 characters: every name below is
truncated, and a suffixed name truncates its base so that base + suffix still fits.
*/}}

{{- define "tpusync-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or fullnameOverride; the release name alone when it already contains the chart name. */}}
{{- define "tpusync-operator.fullname" -}}
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

{{/* The full name with a suffix, within 63 characters: (dict "root" $ "suffix" "metrics"). */}}
{{- define "tpusync-operator.suffixed" -}}
{{- $suffix := printf "-%s" .suffix }}
{{- $base := include "tpusync-operator.fullname" .root | trunc (int (sub 63 (len $suffix))) | trimSuffix "-" }}
{{- printf "%s%s" $base $suffix }}
{{- end }}

{{- define "tpusync-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tpusync-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tpusync-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tpusync-operator.labels" -}}
helm.sh/chart: {{ include "tpusync-operator.chart" . }}
{{ include "tpusync-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: tpusync
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tpusync-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tpusync-operator.fullname" .) .Values.serviceAccount.name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Where releases publish tpusync's images (operator/tpusync_operator/versions.py _REGISTRY). */}}
{{- define "tpusync-operator.defaultRegistry" -}}
ghcr.io/tpusync
{{- end }}

{{/*
Image reference: repository:tag, or repository@digest, the repository moved to imageRegistry
when it is under the default registry (as the operator moves the images it renders). Moving
tags are refused: the chart deploys a pinned operator release.
*/}}
{{- define "tpusync-operator.image" -}}
{{- $img := .Values.image }}
{{- $repo := $img.repository }}
{{- $ours := printf "%s/" (include "tpusync-operator.defaultRegistry" .) }}
{{- if and .Values.imageRegistry (hasPrefix $ours $repo) }}
{{- $repo = printf "%s/%s" .Values.imageRegistry (trimPrefix $ours $repo) }}
{{- end }}
{{- if $img.digest }}
{{- printf "%s@%s" $repo $img.digest }}
{{- else }}
{{- printf "%s:%s" $repo $img.tag }}
{{- end }}
{{- end }}

{{/*
Cross-field checks the schema cannot express. Each failure names the value to change.
Included once, from the Deployment.
*/}}
{{- define "tpusync-operator.validate" -}}
{{- $v := .Values }}
{{- if and (not $v.image.digest) (not $v.image.tag) }}
{{- fail "image.tag: set a pinned version (e.g. the chart's appVersion) or image.digest" }}
{{- end }}
{{- if $v.image.tag }}
{{- $tag := lower $v.image.tag }}
{{- if or (has $tag (list "latest" "nightly" "main" "master" "dev" "edge" "stable" "head")) (hasPrefix "nightly" $tag) (hasSuffix "-snapshot" $tag) }}
{{- fail (printf "image.tag: %q is a moving tag; pin a release version such as %q" $v.image.tag .Chart.AppVersion) }}
{{- end }}
{{- end }}
{{- if and (gt (int $v.replicas) 1) (not $v.peering.enabled) }}
{{- fail (printf "replicas: %d needs peering.enabled=true (kopf peering lets one replica act; --standalone replicas would all reconcile at once)" (int $v.replicas)) }}
{{- end }}
{{- if and (not $v.serviceAccount.create) (not $v.serviceAccount.name) }}
{{- fail "serviceAccount.name: required when serviceAccount.create=false (the operator must run as an existing ServiceAccount)" }}
{{- end }}
{{- if and $v.metrics.enabled (eq (int $v.metrics.port) (int $v.probes.port)) }}
{{- fail (printf "metrics.port and probes.port are both %d; use two different ports" (int $v.probes.port)) }}
{{- end }}
{{- if and (not $v.metrics.enabled) (or $v.metrics.podMonitoring.enabled $v.metrics.serviceMonitor.enabled) }}
{{- fail "metrics.podMonitoring.enabled / metrics.serviceMonitor.enabled need metrics.enabled=true" }}
{{- end }}
{{- if and $v.peering.enabled (not $v.peering.name) }}
{{- fail "peering.name: required when peering.enabled=true" }}
{{- end }}
{{- end }}

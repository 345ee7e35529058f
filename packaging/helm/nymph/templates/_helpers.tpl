{{/* The release name, cut to a DNS label: every object of the release is named so. */}}
{{- define "nymph.fullname" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{- define "nymph.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "nymph.labels" -}}
{{ include "nymph.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
repository:tag, the tag defaulting to the chart's appVersion. values.schema.json makes image.tag a
string: a tag written as a number (tag: 1.0) would reach the template as the float 1 and pull ":1".
*/}}
{{- define "nymph.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end }}

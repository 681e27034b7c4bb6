{{/* Chart name */}}
{{- define "vmfence.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name */}}
{{- define "vmfence.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Common labels; call with (dict "ctx" $ "component" "watcher") */}}
{{- define "vmfence.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: vmfence
{{ include "vmfence.selectorLabels" . }}
{{- end -}}

{{- define "vmfence.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vmfence.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "vmfence.componentName" -}}
{{- printf "%s-%s" (include "vmfence.fullname" .ctx) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vmfence.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "vmfence.natsSecret" -}}
{{- default (printf "%s-nats" (include "vmfence.fullname" .)) .Values.nats.existingSecret -}}
{{- end -}}

{{/* Environment every component shares; call with (dict "ctx" $ "component" "watcher") */}}
{{- define "vmfence.commonEnv" -}}
{{- $ctx := .ctx -}}
- name: VMFENCE_NATS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "vmfence.natsSecret" $ctx }}
      key: url
- name: VMFENCE_PREFIX
  value: {{ $ctx.Values.prefix | quote }}
- name: VMFENCE_PARTITIONS
  value: {{ $ctx.Values.partitions | quote }}
- name: VMFENCE_REPLICAS
  value: {{ $ctx.Values.replicas | quote }}
# probes and Prometheus reach the pod IP: listen on all interfaces
- name: VMFENCE_HTTP_HOST
  value: "0.0.0.0"
- name: VMFENCE_HTTP_PORT
  value: {{ $ctx.Values.httpPort | quote }}
- name: VMFENCE_LOG_FORMAT
  value: {{ $ctx.Values.logFormat | quote }}
{{- if $ctx.Values.nats.tlsCASecret }}
# trust the NATS servers' CA for tls:// URLs (Python's default SSL context reads SSL_CERT_FILE)
- name: SSL_CERT_FILE
  value: /etc/vmfence/nats-tls/ca.crt
{{- end }}
{{- with $ctx.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* NATS user/password from the Secret; optional so that an unauthenticated dev NATS works */}}
{{- define "vmfence.natsUserEnv" -}}
- name: VMFENCE_NATS_USER
  valueFrom:
    secretKeyRef:
      name: {{ include "vmfence.natsSecret" .ctx }}
      key: {{ .user }}-user
      optional: true
- name: VMFENCE_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "vmfence.natsSecret" .ctx }}
      key: {{ .user }}-password
      optional: true
{{- end -}}

{{- define "vmfence.probes" -}}
livenessProbe:
  httpGet:
    path: /livez
    port: metrics
  initialDelaySeconds: 10
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 6
readinessProbe:
  httpGet:
    path: /readyz
    port: metrics
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 3
{{- end -}}

{{- define "vmfence.restrictedSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
RBAC rules: exactly what the operator's code and kopf use (docs/operator.md, "RBAC the
operator needs"; tests/unit/chart/test_chart_rbac.py holds the same list). Server-side apply
needs create (when it creates) and patch; prune needs delete; get: each child is read before it
is written, which is only done where the object is the operator's own.
*/}}

{{/* Cluster-scoped reads: kopf's CRD observation and API discovery, the pool's ready nodes
(watched: a node joining or leaving triggers a pass of its pool). Children are watched
(list, watch) so that drift and readiness changes trigger a pass of their owner. */}}
{{- define "tpusync-operator.clusterScopedRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [nodes]
  verbs: [list, watch]
- nonResourceURLs: [/api, /api/*, /apis, /apis/*]
  verbs: [get]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- if and .Values.peering.enabled (not .Values.watchNamespaces) }}
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end }}

{{/* Everything in a watched namespace (cluster-wide when watchNamespaces is empty). */}}
{{- define "tpusync-operator.namespacedRules" -}}
{{- if and .Values.peering.enabled .Values.watchNamespaces }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
- apiGroups: [tpusync.dev]
  resources: [tpusyncpools, disaggregatedservings]
  verbs: [get, list, watch, patch]
- apiGroups: [tpusync.dev]
  resources: [tpusyncpools/status, disaggregatedservings/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [configmaps, services, serviceaccounts, persistentvolumeclaims]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [apps]
  resources: [deployments, statefulsets, daemonsets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [disaggregatedset.x-k8s.io]
  resources: [disaggregatedsets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [llm-d.ai]
  resources: [inferenceobjectives]
  verbs: [get, list, watch, create, patch, delete]
{{- /* Held only because the EPP Role grants them (RBAC escalation prevention). */}}
- apiGroups: [llm-d.ai, inference.networking.x-k8s.io]
  resources: [inferenceobjectives, inferencemodelrewrites]
  verbs: [get, list, watch]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, update]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, list, watch, create, patch, delete]
{{- /* GKE Gateway's policies for an InferencePool (spec.routing.gkeGatewayPolicies). */}}
- apiGroups: [networking.gke.io]
  resources: [healthcheckpolicies, gcpbackendpolicies]
  verbs: [get, list, watch, create, patch, delete]
{{- end }}

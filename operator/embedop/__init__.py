"""embedop: the embedfleet operator (EmbeddingService → GPU Deployments, Services, autoscaling).

Flat, on purpose: thirty-three modules in two kinds, each named for its job, and a subpackage per kind
would add a level without telling a reader more than this list does.

Pure (dicts and numbers in, dicts and numbers out; tested as tables):
  crd        the CustomResourceDefinition, built here; its schema's defaults
  crd_schema builders of its OpenAPI schema fragments (typed, described fields; a model's fields)
  spec       a spec defaulted, and what no schema can say about it (problems)
  render     spec → the manifests of what a service owns
  render_security  spec.auth, spec.tls → the pod's Secret volumes, mounts and settings
  render_network   spec.networkPolicy → the service's NetworkPolicy
  render_gateway   spec.routing gateway → the service's InferencePool (Gateway API Inference Extension)
  render_keda      autoscaling.mode keda → the service's KEDA ScaledObject; with minReplicas 0, the
                   HTTP add-on's route that wakes it
  render_models    spec.models → the servers' model list (MODELS), what a fill fetches, the Model
                   column's summary
  render_cache     spec.modelCache → the cache's volumes, mounts, settings and fill Job; what the
                   claim's access modes mean for the pods
  drift      whether a live object still is what we render (as the API server stores it), and
             whether what we applied stuck
  status     observations → status fields and conditions
  autoscale  the autoscaling decision (samples, policy, history → replicas)
  demand     a pod's readings per model and the busy seconds they stand for; the demand's trend

I/O, from the edge in:
  kube       the Kubernetes API calls (lightkube), errors sorted for the callers
  cache      informers: the owned kinds listed and watched by label (and the model caches'
             claims); reads from the copies, guarded writes through one Cluster (the leader
             check before each)
  leader     leader election on a coordination.k8s.io Lease
  scope      at start-up: refuse a scope another release's operator already covers (claim Leases)
  write      one owned object written: created when absent, applied when ours, held when
             what we apply does not stick
  reconcile  one reconcile: render, apply what drifted, report status
  reconcile_keda  mode keda's objects in a reconcile: applied, deleted, what the cluster lacks said
  fill       a pre-filled model cache's Job: read, created, and whether the pods wait for it
  scrape     the pods' readings: which pods count, their /metrics (ports, fallback, timeouts)
  autoscaler one autoscaling step: read the pods, decide, scale (mode keda: publish), record
  decisions  mode keda's decisions, for KEDA: each service's count and whether it had demand lately
  scaler     KEDA's external scaler (gRPC), served while this pod leads
  externalscaler_pb2  KEDA's externalscaler.proto, compiled (generated: `make protos`)
  externalscaler_pb2_grpc  its gRPC stubs (generated)
  fleet      one task per service: reconciles and autoscaler steps, kicked by watch events
  handlers   the only module with kopf handlers: startup, the services' events
  config     the operator's settings, from the environment, once
  uninstall  the chart's optional pre-delete hook
  __main__   `python -m embedop`
"""

__version__ = "0.3.0"

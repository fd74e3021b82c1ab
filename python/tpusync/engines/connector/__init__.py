"""The KV connector core that tpusync's two engine connectors share: the vLLM connector
(`tpusync.engines.vllm`, torch caches) and the tpu-inference connector (`tpusync.engines.tpu_inference`, JAX
caches). The scheduler half (keys, lookups, pins, P/D pulls: `scheduler`), the connector methods
both present to vLLM (`base.ConnectorBase`), what the halves exchange (`common`), the options
(`config`; the kv_transfer_params contract is `tpusync.kv.handoff`'s), and the KV events of the
tiers tpusync holds (`events`, published on the pod's KV-events port through `relay`). Each
engine's package holds only its worker half. Importing this package imports neither vLLM nor an
accelerator framework."""

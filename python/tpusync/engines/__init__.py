"""The engines tpusync serves, each a client of the KV plane (`tpusync.kv`) and the store, none of
another: vLLM's KV connector API shared by two engines (`connector`), vLLM (`vllm`), vLLM on TPU
(`tpu_inference`), SGLang's HiCache (`sglang`), the reference JAX engine (`reference`) and
upstream TPU Sync's Python API (`upstream`)."""

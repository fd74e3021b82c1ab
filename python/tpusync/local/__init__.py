"""tpusync on one machine, for the demo, the tests and the benchmarks: start and stop
`tpusync-sidecar` processes (`sidecars`) and reference model servers (`servers`). On Kubernetes
the operator runs both; nothing in the library imports this package."""

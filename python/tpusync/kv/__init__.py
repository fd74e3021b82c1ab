"""The engine-neutral KV plane (issue 42), which engines import and which imports only the store and
errors. Today: the prefill-to-decode contract (`handoff`): what a prefill engine puts in
`kv_transfer_params`, the one typed parser of what a client sends back, and where a decode host
pulls the prefill's blocks from."""

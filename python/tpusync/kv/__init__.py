"""The engine-neutral KV plane (issue 42), which every engine imports and which imports only the
store and errors: block keys and the block scope they derive from (`keys`), the page copies
between a list of layers and store blocks (`pages`), the prefill-to-decode contract every engine
speaks (`handoff`), KV events and their relay (`events`, `relay`), the weights blocks are keyed
under (`served_weights`) and PrefixStore/PageMover (`cache`)."""

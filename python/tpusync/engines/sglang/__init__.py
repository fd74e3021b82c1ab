"""tpusync as an SGLang HiCache L3 storage backend (docs/sglang.md).

SGLang loads it without a patch through its dynamic storage factory::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "tpusync",
        "module_path": "tpusync.sglang.storage", "class_name": "TPUSyncHiCacheStorage",
        "interface_v1": 1}'

`tpusync.sglang.storage` imports SGLang (and torch); `keys` and `plan` do not, and neither does
importing `tpusync` or this package.
"""

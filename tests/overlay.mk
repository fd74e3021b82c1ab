# The engine tiers' overlays (tests/vllm, tests/sglang, tests/tpu_inference): a small venv in
# build/ of this clone that puts an engine's environment (under ~/.cache/tpusync, shared by every
# clone) and this clone's tpusync on one interpreter. Included by the top-level Makefile; each
# tier's .mk calls these canned recipes in its overlay's rule.

# $(call overlay-venv,OVERLAY,PYTHON,ENGINE_ENV,PTH[,VENV_OPTIONS]): a fresh venv OVERLAY made by
# PYTHON, which sees ENGINE_ENV's packages (the same Python version) through its .pth file PTH.
define overlay-venv
rm -rf $(1)
$(2) -m venv $(5) $(1)
@set -e; lib=lib/$$($(2) -c 'import sys; print("python%d.%d" % sys.version_info[:2])')/site-packages; \
echo "import site; site.addsitedir('$(3)/$$lib')" > $(1)/$$lib/$(4)
endef

# $(call overlay-tpusync,OVERLAY): this clone's tpusync as $(VENV) has it installed, in OVERLAY (a
# venv of $(PYTHON)'s version): copies of the editable install's finder, its dist-info, the native
# extension and the sidecar binary, not a second build.
define overlay-tpusync
@set -e; lib=lib/$$($(PYTHON) -c 'import sys; print("python%d.%d" % sys.version_info[:2])')/site-packages; \
here=$(1)/$$lib; \
cp $(VENV)/$$lib/_tpusync_editable.py $(VENV)/$$lib/_tpusync_editable.pth $$here/; \
cp -r $(VENV)/$$lib/tpusync-*.dist-info $$here/; \
mkdir -p $$here/tpusync && cp $(VENV)/$$lib/tpusync/_native*.so $$here/tpusync/; \
cp $(VENV)/bin/tpusync-sidecar $(1)/bin/
endef

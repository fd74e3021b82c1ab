# Container images: included by the top-level Makefile.
#
# `make images` builds every image the operator's defaults name, from images/<dir>/Dockerfile
# (images/python/Dockerfile holds two targets, operator and serving, that share one wheel), into OCI image archives under build/images/ (tpusync-<name>.oci.tar), without a Docker daemon:
# buildah (Debian's), overlay storage and chroot isolation, as root. No container registry is
# reachable here, so the upstream bases the release pins by digest are replaced, through the
# Dockerfiles' own build-args, by bases assembled locally (images/base/local-base.sh: mmdebstrap
# of the same Debian suite; cached under ~/.cache/tpusync/images/, and so is buildah's storage
# with its layer cache). Then tests/images reads each archive (layout, manifest, config: user,
# entrypoint, env, labels with the version) and runs its entrypoint from the unpacked rootfs.
#
#   tpusync-operator, tpusync-serving   FROM bookworm + Debian's CPython 3.11 and its headers (for python:3.11-slim-bookworm)
#   tpusync-sidecar                     builder FROM bookworm (for debian:12-slim); runtime FROM scratch, as released
#   tpusync-vllm-tpu-layer              only the `layer` stage of images/vllm-tpu/Dockerfile: tpusync built
#                                       for CPython 3.12 (pyenv's, for python:3.12-slim-bookworm) and
#                                       installed under /usr/local/lib/python3.12/site-packages.
#
# What cannot be checked here: the tpusync-vllm-tpu image itself. Its base, vllm/vllm-tpu at the
# pinned tag, is a registry image that cannot be pulled or assembled here (vLLM and tpu-inference
# as upstream installs them, libtpu, on python:3.12-slim); no stand-in is built under its name.
# What is checked instead: the layer the release adds to it, imported by the tpu-inference
# tier's real vLLM 0.32.0 + tpu-inference 0.32.0 on CPython 3.12 (tests/images). That the layer
# lands on the base's Python (/usr/local, python3.12) is taken from upstream's Dockerfile and is
# proved only in the release, by the final stage's import check.
.PHONY: images image-tools image-bases image-archives image-test image-check release-test

IMAGE_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_OUT := build/images
IMAGE_CACHE := $(CACHE)/images
# Overlay storage (a layer is a diff, not a copy: vfs copied the whole root filesystem per step).
BUILDAH := buildah --storage-driver overlay --root $(IMAGE_CACHE)/storage --runroot /run/tpusync-buildah
# The layer cache grows with every change of the sources (14 GB after the first builds here);
# past this size it is emptied, and the next build is cold (the bases come back from their
# tarballs in seconds, the compiles and downloads take their time).
IMAGE_STORE_MAX_GB ?= 20
# RUN steps share pip's cache with this machine (the local Python bases have the mount point and
# trust the CA bundle pip is given here: images/base/local-base.sh).
# Their compiles share a ccache of their own (the builders' compiler is not this machine's).
IMAGE_CCACHE := $(CACHE)/ccache-images
IMAGE_BUILD = nice -n 10 $(BUILDAH) bud --layers --isolation chroot --pull-never --quiet \
  -v $(PIP_CACHE_DIR):/root/.cache/pip -v $(IMAGE_CCACHE):/root/.cache/ccache --build-arg VERSION=$(IMAGE_VERSION)

images: image-check image-archives image-test

# buildah and mmdebstrap build the images; skopeo and docker-registry (an OCI registry, Debian's
# build of distribution/distribution) run the release in release-test. Installing
# docker-registry enables its system service on port 5000 of every interface where systemd runs:
# stopped and disabled at once (the release test starts its own, on 127.0.0.1).
image-tools:
	@missing=$$(for p in buildah mmdebstrap skopeo docker-registry; do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing $$missing"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  case " $$missing " in *" docker-registry "*) \
	    if [ -d /run/systemd/system ]; then $$SUDO systemctl disable --now docker-registry.service >/dev/null 2>&1 || true; fi;; \
	  esac; \
	fi

image-bases: image-tools
	@mkdir -p $(IMAGE_CACHE) $(IMAGE_OUT) $(PIP_CACHE_DIR) $(IMAGE_CCACHE); \
	if [ -d $(IMAGE_CACHE)/storage ] && [ $$(du -s --block-size=1G $(IMAGE_CACHE)/storage | cut -f1) -gt $(IMAGE_STORE_MAX_GB) ]; then \
	  echo "images: layer cache over $(IMAGE_STORE_MAX_GB) GB, emptied"; $(BUILDAH) rmi --all --force >/dev/null; \
	fi
	BUILDAH="$(BUILDAH)" CACHE_DIR=$(IMAGE_CACHE) images/base/local-base.sh bookworm > $(IMAGE_OUT)/base-bookworm
	BUILDAH="$(BUILDAH)" CACHE_DIR=$(IMAGE_CACHE) images/base/local-base.sh python3.11 > $(IMAGE_OUT)/base-python3.11
	BUILDAH="$(BUILDAH)" CACHE_DIR=$(IMAGE_CACHE) images/base/local-base.sh python3.12 > $(IMAGE_OUT)/base-python3.12

# $(call image,NAME,DIR,BASE-ARG,BASE-FILE[,TARGET]): build (log in build/images/NAME.log), then
# write the OCI archive.
define image
	@echo "images: $(1) (images/$(2)/Dockerfile$(if $(5), --target $(5)))"
	@set -e; start=$$(date +%s); \
	$(IMAGE_BUILD) --build-arg $(3)=$$(cat $(IMAGE_OUT)/$(4)) $(if $(5),--target $(5)) \
	  --ignorefile images/$(2)/Dockerfile.dockerignore -f images/$(2)/Dockerfile \
	  -t localhost/tpusync/$(1):$(IMAGE_VERSION) . >$(IMAGE_OUT)/$(1).log 2>&1 \
	  || { tail -60 $(IMAGE_OUT)/$(1).log; echo "images: $(1) failed (log: $(IMAGE_OUT)/$(1).log)"; exit 1; }; \
	rm -f $(IMAGE_OUT)/$(1).oci.tar; \
	$(BUILDAH) push --quiet localhost/tpusync/$(1):$(IMAGE_VERSION) oci-archive:$(IMAGE_OUT)/$(1).oci.tar:$(IMAGE_VERSION); \
	echo "images: $(1): $$(du -h $(IMAGE_OUT)/$(1).oci.tar | cut -f1) in $$(( $$(date +%s) - start )) s"
endef

image-archives: image-bases | system-deps
	$(call image,tpusync-sidecar,sidecar,DEBIAN_BASE,base-bookworm)
	$(call image,tpusync-operator,python,PYTHON_BASE,base-python3.11,operator)
	$(call image,tpusync-serving,python,PYTHON_BASE,base-python3.11,serving)
	$(call image,tpusync-vllm-tpu-layer,vllm-tpu,PYTHON_BASE,base-python3.12,layer)

# The archives, read and run; the vLLM layer against the tpu-inference tier's environment.
image-test: install tpu-inference-env
	TPUSYNC_IMAGES=$(IMAGE_OUT) TPUSYNC_VLLM_TPU_PYTHON=$(TPUINF_ENV)/bin/python \
	  $(PY) -m pytest -q -p no:cacheprovider tests/images

# The release, run for real (tests/release): images/release.sh, the steps
# .github/workflows/release.yml runs, pushes every archive above and the chart to an OCI registry
# (docker-registry) the test starts on 127.0.0.1; the chart is installed from it onto the real
# control plane with imageRegistry pointing there, and every image reference the chart and the
# operator render is resolved in it by digest. The vLLM-TPU image is named as not resolvable here
# (no archive of it: see above).
release-test: image-archives controlplane install
	TPUSYNC_RELEASE_ARCHIVES=$(IMAGE_OUT) TPUSYNC_CONTROLPLANE_DIR=$(CONTROLPLANE_DIR) \
	  $(PY) -m pytest -q -p no:cacheprovider tests/release

# Before building: the Dockerfiles' lint, every published version in agreement, and the release
# workflow checked by actionlint (pinned, from the Go module proxy, cached).
ACTIONLINT_VERSION := v1.7.7
ACTIONLINT := $(CACHE)/tools/actionlint-$(ACTIONLINT_VERSION)/actionlint
$(ACTIONLINT):
	GOBIN=$(dir $@) nice -n 10 go install github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION)

image-check: install $(ACTIONLINT)
	$(PY) -m pytest -q tests/unit/images
	$(PY) images/check-versions.py
	$(ACTIONLINT) -shellcheck= .github/workflows/release.yml

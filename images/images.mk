# Container image targets: included by the top-level Makefile.
# There is no Docker daemon or registry here, so each image-steps-<name> target performs the
# builder stage of images/<name>/Dockerfile on this machine, into build/image-<name>/, and
# proves the image's entrypoint. The Dockerfiles stay the definition of the real images: keep
# both in step. image-check lints the Dockerfiles (pinned bases, non-root USER).
.PHONY: image-steps image-steps-operator image-steps-sidecar image-check

IMAGE_JOBS ?= 2
IMAGE_OPERATOR := build/image-operator
IMAGE_SIDECAR := build/image-sidecar

image-steps: image-check image-steps-operator image-steps-sidecar

# Dockerfile: python -m venv /opt/venv && pip install '.[operator]' && python -m tpusync_operator --help
# (a separate scikit-build build dir, so the .venv's editable build in build/wheel is untouched).
image-steps-operator: | system-deps
	rm -rf $(IMAGE_OPERATOR)/venv
	$(PYTHON) -m venv $(IMAGE_OPERATOR)/venv
	CMAKE_BUILD_PARALLEL_LEVEL=$(IMAGE_JOBS) nice -n 10 $(IMAGE_OPERATOR)/venv/bin/pip install -q \
	  -C build-dir=$(CURDIR)/$(IMAGE_OPERATOR)/wheel '.[operator]'
	$(IMAGE_OPERATOR)/venv/bin/python -m tpusync_operator --help
	@# --help stops before the handlers import; prove the extra brings every runtime dependency.
	$(IMAGE_OPERATOR)/venv/bin/python -c "import tpusync_operator.handlers, tpusync._native"

# Dockerfile: cmake -G Ninja (Release, no Python, no tests) && build tpusync-sidecar &&
# collect-rootfs.sh && tpusync-sidecar --help. Here the binary then runs from the collected
# rootfs's own loader and libraries, which proves the distroless-style rootfs is complete.
image-steps-sidecar: | system-deps
	cmake -S . -B $(IMAGE_SIDECAR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DTPUSYNC_BUILD_PYTHON=OFF -DTPUSYNC_BUILD_TESTS=OFF >/dev/null
	@set -e; \
	nice -n 10 cmake --build $(IMAGE_SIDECAR) --target tpusync-sidecar --parallel $(IMAGE_JOBS); \
	bin=$$(find $(IMAGE_SIDECAR) -type f -name tpusync-sidecar -perm -u+x -not -path '*/rootfs/*'); \
	images/sidecar/collect-rootfs.sh "$$bin" $(IMAGE_SIDECAR)/rootfs; \
	root=$(IMAGE_SIDECAR)/rootfs; \
	interp=$$(readelf -l "$$bin" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p'); \
	libs=$$(find "$$root" -name '*.so*' -printf '%h\n' | sort -u | paste -sd:); \
	"$$root$$interp" --inhibit-cache --library-path "$$libs" "$$root/usr/local/bin/tpusync-sidecar" --help

image-check: install
	$(PY) -m pytest -q tests/unit/images

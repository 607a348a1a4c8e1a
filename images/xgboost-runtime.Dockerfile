# The image runtimes/xgboost-distributed.yaml names: Trainer's XGBoost runtime image
# with trainlet as ENTRYPOINT, as `torchrun`, and as the `python` that the
# Kubeflow SDK's command runs (`bash -c "...; python "file.py""`).
#
#   podman build -f images/xgboost-runtime.Dockerfile -t ghcr.io/trainlet/xgboost-runtime:0.1.0 .
#
# Build args (fully qualified names: podman and buildah refuse short ones):
#   BASE_IMAGE       any image with Python and XGBoost
#                    (default ghcr.io/kubeflow/trainer/xgboost-runtime:v2.3.0)
#   RUST_IMAGE       the builder (default docker.io/library/rust:1-bookworm)
#   TRAINLET_BINARY  `build` (default) or `prebuilt` (the release binary from the context)
ARG BASE_IMAGE=ghcr.io/kubeflow/trainer/xgboost-runtime:v2.3.0
ARG RUST_IMAGE=docker.io/library/rust:1-bookworm
ARG TRAINLET_BINARY=build

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked \
 && cp target/x86_64-unknown-linux-gnu/release/trainlet /trainlet

FROM scratch AS prebuilt
COPY target/x86_64-unknown-linux-gnu/release/trainlet /trainlet

FROM ${TRAINLET_BINARY} AS binary

FROM ${BASE_IMAGE}
COPY --from=binary /trainlet /usr/local/bin/trainlet
# `torchrun` on PATH is trainlet (before the base's own in /opt/conda/bin or /usr/bin).
RUN ln -sf /usr/local/bin/trainlet /usr/local/bin/torchrun
# `python` and `python3` first on PATH are trainlet too, in a directory of their own (python
# images keep the real interpreter in /usr/local/bin). The SDK's entry `python FILE.py` in a
# pod of Trainer's JAX/XGBoost policy runs as `trainlet run FILE.py`; every other call
# (`python -m pip ...`, `python -c ...`, any python a worker starts) execs the real
# interpreter, found on PATH past the links (src/cmd/python.rs). Links only: nothing is
# written at run time (any uid, read-only root).
RUN mkdir -p /usr/local/lib/trainlet/python \
 && ln -sf /usr/local/bin/trainlet /usr/local/lib/trainlet/python/python \
 && ln -sf /usr/local/bin/trainlet /usr/local/lib/trainlet/python/python3
ENV PATH=/usr/local/lib/trainlet/python:/usr/local/bin:${PATH}
ENTRYPOINT ["/usr/local/bin/trainlet"]
CMD ["run", "--help"]

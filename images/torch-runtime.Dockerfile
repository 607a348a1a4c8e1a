# The image runtimes/torch-distributed.yaml and torch-with-initializers.yaml
# name: a PyTorch base with trainlet as ENTRYPOINT and as `torchrun`, so a
# TrainJob's `torchrun train.py` (or the Kubeflow SDK's command) runs under
# trainlet unchanged.
#
#   podman build -f images/torch-runtime.Dockerfile -t ghcr.io/trainlet/torch-runtime:0.1.0 .
#
# Build args (fully qualified names: podman and buildah refuse short ones):
#   BASE_IMAGE       any image with Python and PyTorch
#                    (default docker.io/pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime)
#   RUST_IMAGE       the builder (default docker.io/library/rust:1-bookworm)
#   TRAINLET_BINARY  `build` (default) or `prebuilt` (the release binary from the context)
ARG BASE_IMAGE=docker.io/pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
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
ENV PATH=/usr/local/bin:${PATH}
ENTRYPOINT ["/usr/local/bin/trainlet"]
CMD ["run", "--help"]

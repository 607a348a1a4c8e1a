# The image runtimes/mpi-distributed.yaml names: Open MPI and mpi4py, trainlet
# as sshd, ssh and mpirun, and no OpenSSH at all; uid 1000 `mpiuser` as in
# Trainer's MPI images.
#
#   podman build -f images/mpi-runtime.Dockerfile -t ghcr.io/trainlet/mpi-runtime:0.1.0 .
#
# Build args (fully qualified names: podman and buildah refuse short ones):
#   BASE_IMAGE       a Debian bookworm image (default docker.io/library/debian:bookworm-slim)
#   RUST_IMAGE       the builder (default docker.io/library/rust:1-bookworm)
#   TRAINLET_BINARY  `build` (default) or `prebuilt` (the release binary from the context)
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
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
# openmpi-bin depends on openssh-client only for its default remote shell,
# which trainlet's `ssh` replaces: it is removed, so no OpenSSH binary is in
# the image at all.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openmpi-bin python3 python3-mpi4py ca-certificates \
 && dpkg --purge --force-depends openssh-client \
 && rm -rf /var/lib/apt/lists/* \
 && useradd -m -u 1000 mpiuser
COPY --from=binary /trainlet /usr/local/bin/trainlet
# /usr/local/bin precedes /usr/bin on PATH: `ssh` is trainlet's client, and a
# TrainJob's own `mpirun ...` runs as `trainlet mpi -- /usr/bin/mpirun ...`.
# /usr/sbin/sshd too: Trainer's own MPI runtimes (`/usr/sbin/sshd -De -f
# /home/mpiuser/.sshd_config`) then run trainlet's server unchanged.
RUN for n in ssh mpirun mpiexec torchrun; do ln -s trainlet /usr/local/bin/$n; done \
 && ln -s /usr/local/bin/trainlet /usr/sbin/sshd
ENV HOME=/home/mpiuser TRAINLET_SSH_DIR=/home/mpiuser/.ssh TRAINLET_AGENT_DIR=/tmp/trainlet-bin
USER 1000
WORKDIR /home/mpiuser
ENTRYPOINT ["/usr/local/bin/trainlet"]
CMD ["sshd"]

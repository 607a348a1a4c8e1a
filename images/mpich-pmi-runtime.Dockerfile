# The image runtimes/mpich-pmi.yaml names: MPI without SSH. Debian's MPICH
# runtime library, Python, Slurm's libpmi2 (for Intel MPI's PMI-2:
# I_MPI_PMI_LIBRARY=/usr/lib/x86_64-linux-gnu/libpmi2.so.0) and trainlet as
# ENTRYPOINT; no mpirun, no hydra, no OpenSSH. Every node pod runs
# `trainlet run --framework mpi`, which starts the ranks and serves them
# PMI. uid 1000 `mpiuser` as in Trainer's MPI images.
#
# mpi4py: its PyPI wheel runs on this MPICH as the image sets it up
# (MPI4PY_MPIABI=mpich, libmpich.so.12 reachable as libmpi.so.12). Add it
# in an image of your own (`pip install mpi4py==4.1.2` on top of this one),
# or mount it: the container test mounts the test venv's.
#
#   podman build -f images/mpich-pmi-runtime.Dockerfile -t ghcr.io/trainlet/mpich-pmi-runtime:0.1.0 .
#
# Build args (fully qualified names: podman and buildah refuse short ones):
#   BASE_IMAGE       a Debian bookworm image (default docker.io/library/debian:bookworm-slim)
#   RUST_IMAGE       the builder (default docker.io/library/rust:1-bookworm)
#   TRAINLET_BINARY  `build` (default) or `prebuilt` (the release binary from the context)
# Programs built against Debian's MPICH (libmpich-dev, `mpicc.mpich`) run
# here as they are.
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
# mpi4py's wheel loads libmpi.so.12 (MPICH's ABI) when MPI4PY_MPIABI=mpich:
# Debian names MPICH's library libmpich.so.12, so a link in a directory of
# its own gives it that name without touching Open MPI's alternatives.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libmpich12 libpmi2-0 python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /opt/mpi/libmpi \
 && ln -s /usr/lib/x86_64-linux-gnu/libmpich.so.12 /opt/mpi/libmpi/libmpi.so.12 \
 && useradd -m -u 1000 mpiuser
COPY --from=binary /trainlet /usr/local/bin/trainlet
ENV LD_LIBRARY_PATH=/opt/mpi/libmpi \
    MPI4PY_MPIABI=mpich \
    TRAINLET_FRAMEWORK=mpi \
    HOME=/home/mpiuser
USER 1000
WORKDIR /home/mpiuser
ENTRYPOINT ["/usr/local/bin/trainlet"]
CMD ["run", "--help"]

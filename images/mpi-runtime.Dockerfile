# MPI runtime image for runtimes/mpi-distributed.yaml: Open MPI and mpi4py,
# trainlet as sshd, ssh and mpirun, and no OpenSSH at all.
# Build from the repository root:
#   docker build -f images/mpi-runtime.Dockerfile -t ghcr.io/trainlet/mpi-runtime .
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked \
 && cp target/x86_64-unknown-linux-gnu/release/trainlet /trainlet

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends openmpi-bin python3 python3-mpi4py ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd -m -u 1000 mpiuser
COPY --from=build /trainlet /usr/local/bin/trainlet
# /usr/local/bin precedes /usr/bin on PATH: `ssh` is trainlet's client, and a
# TrainJob's own `mpirun ...` runs as `trainlet mpi -- /usr/bin/mpirun ...`.
RUN for n in ssh mpirun mpiexec torchrun; do ln -s trainlet /usr/local/bin/$n; done \
 && ln -s /usr/local/bin/trainlet /usr/sbin/sshd
# /usr/sbin/sshd too: Trainer's own MPI runtimes (`/usr/sbin/sshd -De -f
# /home/mpiuser/.sshd_config`) then run trainlet's server unchanged.
ENV HOME=/home/mpiuser TRAINLET_SSH_DIR=/home/mpiuser/.ssh TRAINLET_AGENT_DIR=/tmp/trainlet-bin
USER 1000
WORKDIR /home/mpiuser
ENTRYPOINT ["trainlet"]
CMD ["sshd"]

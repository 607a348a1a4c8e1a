# The image runtimes/mpich-pmi.yaml names: MPI without SSH. MPICH 5.0.2
# from PyPI's `mpich` wheel, Python, Slurm's libpmi2 (for Intel MPI's PMI-2:
# I_MPI_PMI_LIBRARY=/usr/lib/x86_64-linux-gnu/libpmi2.so.0) and trainlet as
# ENTRYPOINT; no mpirun, no hydra, no OpenSSH. Every node pod runs
# `trainlet run --framework mpi`, which starts the ranks and serves them
# PMI. uid 1000 `mpiuser` as in Trainer's MPI images.
#
# Why not Debian's MPICH: bookworm's 4.0.2 (ch4:ucx) can hang in
# MPI_Finalize when the ranks are on two pods. Each rank closes its UCX
# endpoints, then waits in a PMI barrier, where it no longer progresses
# UCX; a rank whose endpoint close needs a peer that already waits there
# never gets to the barrier. MPICH removed that barrier in 4.2
# (pmodels/mpich#6596). Measured with this image's test under load: 1 run
# in 3 hung with Debian's 4.0.2, none in 40 with 5.0.2. Under hydra the
# same MPICH hangs the same way: it is not the launcher's.
#
# MPICH keeps its ABI (libmpi.so.12): programs built against Debian's MPICH
# (libmpich-dev, `mpicc.mpich`, which link libmpich.so.12) run here as they
# are, through a link of that name. mpi4py's wheel runs on it with
# MPI4PY_MPIABI=mpich (set here). Add it in an image of your own
# (`pip install mpi4py==4.1.2` on top of this one), or mount it: the
# container test mounts the test venv's.
#
#   podman build -f images/mpich-pmi-runtime.Dockerfile -t ghcr.io/trainlet/mpich-pmi-runtime:0.1.0 .
#
# Build args (fully qualified names: podman and buildah refuse short ones):
#   BASE_IMAGE       a Debian bookworm image (default docker.io/library/debian:bookworm-slim)
#   RUST_IMAGE       the builder (default docker.io/library/rust:1-bookworm)
#   TRAINLET_BINARY  `build` (default) or `prebuilt` (the release binary from the context)
#   MPICH_LIBS       `mpich-pypi` (default: the wheel, fetched and checked
#                    against its sha256) or `mpich-prebuilt`
#                    (target/containers/mpich from the context: the same
#                    wheel's libraries, which tests/images.sh puts there
#                    from the test venv)
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
ARG RUST_IMAGE=docker.io/library/rust:1-bookworm
ARG TRAINLET_BINARY=build
ARG MPICH_LIBS=mpich-pypi

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked \
 && cp target/x86_64-unknown-linux-gnu/release/trainlet /trainlet

FROM scratch AS prebuilt
COPY target/x86_64-unknown-linux-gnu/release/trainlet /trainlet

FROM ${TRAINLET_BINARY} AS binary

# MPICH's libraries from the wheel: libmpi.so.12 and what it loads from
# mpich/ beside it (its RUNPATH is $ORIGIN:$ORIGIN/mpich: UCX, libfabric).
FROM ${BASE_IMAGE} AS mpich-pypi
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-pip ca-certificates \
 && printf 'mpich==5.0.2 --hash=sha256:8fed465ebff269ea2ebac179a25de02671ddf8df476e0f115be089015015cfd4\n' > /tmp/req.txt \
 && python3 -m pip download --no-deps --only-binary=:all: --require-hashes -r /tmp/req.txt --dest /tmp/wheel \
 && python3 -m zipfile -e /tmp/wheel/mpich-5.0.2-*.whl /tmp/x \
 && mkdir /mpich \
 && cp -a /tmp/x/mpich-5.0.2.data/data/lib/libmpi.so.12 /tmp/x/mpich-5.0.2.data/data/lib/mpich /tmp/x/mpich-5.0.2.dist-info/licenses /mpich/

FROM scratch AS mpich-prebuilt
COPY target/containers/mpich /mpich

FROM ${MPICH_LIBS} AS mpich

FROM ${BASE_IMAGE}
# mpi4py's wheel loads libmpi.so.12 (MPICH's ABI) when MPI4PY_MPIABI=mpich;
# programs built against Debian's MPICH load libmpich.so.12: both names
# are MPICH 5.0.2's library, in a directory of its own on LD_LIBRARY_PATH.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libpmi2-0 python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd -m -u 1000 mpiuser
COPY --from=mpich /mpich /opt/mpi/libmpi
RUN ln -s libmpi.so.12 /opt/mpi/libmpi/libmpich.so.12
COPY --from=binary /trainlet /usr/local/bin/trainlet
ENV LD_LIBRARY_PATH=/opt/mpi/libmpi \
    MPI4PY_MPIABI=mpich \
    TRAINLET_FRAMEWORK=mpi \
    HOME=/home/mpiuser
USER 1000
WORKDIR /home/mpiuser
ENTRYPOINT ["/usr/local/bin/trainlet"]
CMD ["run", "--help"]

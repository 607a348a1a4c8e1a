# trainlet alone, FROM scratch: the static binary at /usr/local/bin/trainlet.
# For initializer containers (`trainlet init dataset|model`) and as the
# source of `COPY --from` into an image you already have (the book,
# docs/src/runtimes.md, "Adopting trainlet in your runtime").
#
#   podman build -f images/trainlet.Dockerfile -t ghcr.io/trainlet/trainlet:0.1.0 .
#
# Build args (fully qualified names: podman and buildah refuse short ones):
#   RUST_IMAGE       the builder (default docker.io/library/rust:1-bookworm)
#   TRAINLET_BINARY  `build` (default: compile in RUST_IMAGE) or `prebuilt`
#                    (take target/x86_64-unknown-linux-gnu/release/trainlet
#                    from the context; no builder image needed)
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

FROM scratch
COPY --from=binary /trainlet /usr/local/bin/trainlet
ENTRYPOINT ["/usr/local/bin/trainlet"]

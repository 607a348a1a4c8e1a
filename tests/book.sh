#!/usr/bin/env bash
# Builds the book (docs/) into target/book with mdBook, installing the pinned
# mdBook into cargo's bin directory first when it is missing (once). It is
# built in cargo's debug profile: a fresh machine compiled the optimized
# build from source in 507 s, the first of the test command's steps; the
# book is small enough for the unoptimized mdBook. Broken links between the
# book's pages and README.md fail `cargo test` (tests/it/docs.rs), not this
# script: mdBook does not check them.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.5.4
bin="${CARGO_HOME:-$HOME/.cargo}/bin"
mdbook="$bin/mdbook"
if [ "$("$mdbook" --version 2>/dev/null)" != "mdbook v$version" ]; then
  echo "installing mdbook $version into $bin (once)"
  # From / with RUSTFLAGS unset: this repository's .cargo/config.toml and the
  # test command's +crt-static are for trainlet, not for a tool built on the
  # host. Only the search feature: the test needs `build`, not `serve`.
  (cd / && env -u RUSTFLAGS -u CARGO_BUILD_TARGET cargo install --locked --debug --quiet mdbook \
    --version "$version" --no-default-features --features search)
fi
"$mdbook" build docs
echo "book built: target/book/index.html"

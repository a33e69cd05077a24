# syntax=docker/dockerfile:1

# --- build stage -------------------------------------------------------------
FROM rust:1-bookworm AS build
WORKDIR /src

# Everything the crate needs (src/, migrations/ via include_str!, Cargo.lock);
# .dockerignore keeps target/ and .git/ out of the context.
COPY . .
RUN cargo build --release --locked --bin pgapply \
 && cp target/release/pgapply /usr/local/bin/pgapply

# --- runtime stage -----------------------------------------------------------
FROM debian:bookworm-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system pgapply \
 && useradd --system --gid pgapply --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin pgapply

COPY --from=build /usr/local/bin/pgapply /usr/local/bin/pgapply

USER pgapply
ENTRYPOINT ["/usr/local/bin/pgapply"]

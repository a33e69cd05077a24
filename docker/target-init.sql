-- Target database for the docker-compose demo: the same table, empty. pgapply copies the
-- source's rows into it (--copy-data), then applies the changes published by the source
-- (pgapply_pub).

CREATE TABLE public.sample (
    id         bigserial   PRIMARY KEY,
    note       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

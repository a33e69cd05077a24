-- Source database for the docker-compose demo (runs once, on an empty data directory).
-- The server is started with wal_level=logical (see docker-compose.yml).

CREATE TABLE public.sample (
    id         bigserial   PRIMARY KEY,
    note       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO public.sample (note) VALUES
    ('first row'),
    ('second row'),
    ('third row');

CREATE PUBLICATION pgapply_pub FOR TABLE public.sample;

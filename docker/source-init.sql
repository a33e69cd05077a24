-- Source database for the docker-compose demo (runs once, on an empty data directory).
-- The server is started with wal_level=logical (see docker-compose.yml).

CREATE TABLE public.sample (
    id         bigserial   PRIMARY KEY,
    note       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Rows that exist before pgapply starts: its initial copy (--copy-data) brings them over.
INSERT INTO public.sample (id, note, created_at) VALUES
    (1, 'first row',  '2024-01-01 00:00:00+00'),
    (2, 'second row', '2024-01-01 00:00:01+00'),
    (3, 'third row',  '2024-01-01 00:00:02+00');
SELECT setval('public.sample_id_seq', 3);

CREATE PUBLICATION pgapply_pub FOR TABLE public.sample;

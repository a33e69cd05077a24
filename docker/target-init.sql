-- Target database for the docker-compose demo: the same table, seeded with the
-- same rows as the source.
-- pgapply applies the changes published by the source (pgapply_pub) into it.

CREATE TABLE public.sample (
    id         bigserial   PRIMARY KEY,
    note       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO public.sample (id, note, created_at) VALUES
    (1, 'first row',  '2024-01-01 00:00:00+00'),
    (2, 'second row', '2024-01-01 00:00:01+00'),
    (3, 'third row',  '2024-01-01 00:00:02+00');
SELECT setval('public.sample_id_seq', 3);

-- The error a failed run ended with, for `pgapply status` (state 'failed').
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS last_error text;

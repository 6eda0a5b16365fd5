-- Named statements of engine/health/diagnosis.py. {intent}, {correlation}, {table} and
-- {time_column} are the column and table names a job type declares for its effects (code,
-- never input).

-- intent_rows --
-- Each effect row's intent and correlation id (NULL when the table keeps none).
SELECT {intent}, {correlation} FROM {table};

-- intent_rows_since --
-- The same for the rows written at or after :since.
SELECT {intent}, {correlation} FROM {table} WHERE {time_column} >= :since;

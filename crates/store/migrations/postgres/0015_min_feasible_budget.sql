-- lastcall ledger, version 14: a worker's refusal for lack of time (`expired_not_started`
-- with a reason such as `receipt:expected_wait_exceeds_budget`, `admission:deadline_passed`,
-- `admission:below_learned_runtime`) records `min_feasible_budget_ms`: the budget the check
-- that refused the job would have admitted at that instant (its expected wait for a slot,
-- the clock margin and the minimum useful runtime it applied). NULL for every other
-- outcome, and for refusals recorded before this version.

ALTER TABLE jobs ADD COLUMN min_feasible_budget_ms BIGINT;

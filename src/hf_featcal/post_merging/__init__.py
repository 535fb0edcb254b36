"""Post-merging steps: what runs on a merged model after merging (representation corrections such as
Representation Surgery and ProbSurgery, in `surgery`, `task_modules`, `representation`, `corrections`)."""

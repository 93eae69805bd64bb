"""``reservoir versus placement``: OpenStack Placement, claimed against as Nova's scheduler
does, measured beside reservoir's own bench with the same nodes and flavour in one run."""

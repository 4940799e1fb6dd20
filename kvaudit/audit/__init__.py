"""The audit: hooks on a target's pools, the ledger, the oracles and what a finding is."""

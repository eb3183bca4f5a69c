"""The data structures every runtime part shares: the varlen store, the token ledger, budget allocations."""

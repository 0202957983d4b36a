"""`waltz demo`: a bank ledger on a local cluster (`bank`), its client processes (`teller`) and
the run with its verification (`runner`)."""

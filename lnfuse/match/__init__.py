"""Match: the algebraic normal form and the backward matcher the rules are written in, what a rule is, and norm-like
candidates found independently of the rules."""

"""Conformance profiles: what a message of a connection must look like (docs/profiles.md).

`load.read_profiles` reads profile files into `Profile`s (every problem at once, each naming the
file and key); `check.findings` tests one message against them and says what is wrong and where,
as `Finding`s carrying HL7 table 0357 codes. Plain Python, no store, no Spark, no Twisted: the
listener, the config check and the tests all call the same code.
"""

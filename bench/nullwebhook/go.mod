module dispatch-admission/bench/nullwebhook

go 1.22

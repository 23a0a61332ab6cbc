from tracer.cli import console_main

console_main()

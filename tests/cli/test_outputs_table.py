"""The table of outputs (tracer.reports.report_dir.OUTPUTS) is what the command line writes: `--report DIR`
holds every file of the table (layer.svg when graphviz is installed), and the single flag of an output
writes the bytes of its report file, under the same file name (`--lines` prints them)."""
from tracer.cli.analyze import build_parser
from tracer.errors import ExitCode
from tracer.reports.layer_graph import dot_binary
from tracer.reports.report_dir import OUTPUTS

STEP = ("llama-debug", "--target", "cpu", "--batch", "1", "--seq", "16", "--quiet")


def test_every_flag_of_the_table_is_a_flag_of_the_command_line():
    flags = build_parser()._option_string_actions
    assert [output.flag for output in OUTPUTS if output.flag and output.flag not in flags] == []


def test_each_single_flag_writes_the_bytes_of_its_report_file(run_cli, shared_analyses, tmp_path):
    report = tmp_path / "report"
    code, _, err = run_cli(*STEP, "--report", report)
    assert code == ExitCode.OK, err
    names = {file.name for output in OUTPUTS for file in output.files}
    assert {p.name for p in report.iterdir()} == names - ({"layer.svg"} if dot_binary() is None else set())

    for output in (o for o in OUTPUTS if o.flag):
        for file in output.files:
            expected = (report / file.name).read_bytes()
            if output.switch:
                code, out, err = run_cli(*STEP, output.flag)
                assert code == ExitCode.OK and out.endswith("\n" + expected.decode()), (output.flag, err)
                continue
            single = tmp_path / "single" / file.name
            code, _, err = run_cli(*STEP, output.flag, single)
            assert code == ExitCode.OK and single.read_bytes() == expected, (output.flag, file.name, err)

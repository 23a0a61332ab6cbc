"""In a Jupyter notebook an Analysis displays itself: a real kernel (ipykernel, run by nbclient) executes a
cell ending in the analysis, and the cell's rich output is the report's summary, timeline plot, policy table
and top lines as HTML."""
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


@pytest.mark.slow
def test_an_analysis_shows_itself_in_a_real_kernel():
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(
        "import tracer\n"
        "analysis = tracer.analyze('llama-debug', batch=1, seq=16, target='cpu', policies=('eager', 'full'))\n"
        "analysis")]
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3").execute()
    (output,) = [o for o in notebook.cells[0].outputs if o.get("output_type") == "execute_result"]
    html = output["data"]["text/html"]
    assert html.startswith('<div class="tracer-report">') and "<svg" in html
    import tracer
    peak = tracer.analyze("llama-debug", batch=1, seq=16, target="cpu").policies["eager"].peak_bytes
    assert f"{peak:,}" in html or f'data-sort="{peak}"' in html          # the same step's peak, in the summary
    assert 'id="policy-table"' in html and ">full<" in html and 'id="line-table"' in html
    assert "<script" not in html

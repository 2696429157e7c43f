from ckptkit.cli import app

app(prog_name="ckptkit")

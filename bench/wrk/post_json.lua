-- POST the same JSON body on every request.
--
--   wrk ... -s bench/wrk/post_json.lua URL -- BODY_FILE ["Header: value" ...]
--
-- BODY_FILE holds the request body (a file, so that no shell quoting is involved).
-- The path is taken from the URL.

local here = debug.getinfo(1, "S").source:sub(2):match("^(.*/)") or "./"
local common = dofile(here .. "common.lua")

function setup(thread) common.setup(thread) end

function init(args)
  assert(args[1], "usage: -- BODY_FILE [\"Header: value\" ...]")
  wrk.method = "POST"
  wrk.body = common.read_file(args[1])
  wrk.headers["Content-Type"] = "application/json"
  common.apply_headers(args, 2)
end

response = common.response
done = common.done

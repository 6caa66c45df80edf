-- GET one resource per request, cycling round-robin through a list of ids.
--
--   wrk ... -s bench/wrk/get_ids.lua URL -- IDS_FILE PATH_TEMPLATE ["Header: value" ...]
--
-- IDS_FILE has one id per line; PATH_TEMPLATE contains "{id}", e.g.
-- "/runs/{id}" or "/api/2.0/mlflow/runs/get?run_id={id}". Each wrk thread starts
-- at a different offset so that threads do not ask for the same id in lockstep.

local here = debug.getinfo(1, "S").source:sub(2):match("^(.*/)") or "./"
local common = dofile(here .. "common.lua")

function setup(thread) common.setup(thread) end

local paths = {}
local next_index = 1

function init(args)
  assert(args[1] and args[2], "usage: -- IDS_FILE PATH_TEMPLATE [\"Header: value\" ...]")
  assert(args[2]:find("{id}", 1, true), "PATH_TEMPLATE must contain {id}")
  for _, id in ipairs(common.read_lines(args[1])) do
    paths[#paths + 1] = args[2]:gsub("{id}", function() return id end)
  end
  common.apply_headers(args, 3)
  -- Spread the threads' starting points over the list.
  next_index = ((thread_index or 0) * 7919) % #paths + 1
end

function request()
  local path = paths[next_index]
  next_index = next_index % #paths + 1
  return wrk.format("GET", path)
end

response = common.response
done = common.done

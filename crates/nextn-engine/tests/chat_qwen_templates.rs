//! Qwen-family chat templates rendered by our environment must equal Python Jinja2 under Hugging
//! Face's settings (trim_blocks, lstrip_blocks, `tojson` = `json.dumps(ensure_ascii=False)`).
//!
//! `QWEN3_TEMPLATE` is the Qwen3 chat template as published with the Qwen3 models (reconstructed
//! from memory, not byte-checked against an official file). `XML_TOOLS_TEMPLATE` is written in the
//! style of the Qwen3.5 / Qwen3-Coder templates (XML tool calls, macros, `|items`, `is mapping`,
//! `tojson | safe`, `|string`, `raise_exception`, `loop.previtem` / `loop.nextitem`). The expected
//! prompts were produced once with jinja2 3.1.6 (ImmutableSandboxedEnvironment, trim_blocks,
//! lstrip_blocks, loopcontrols) from the same templates and inputs, and pasted here.

use nextn_engine::chat::{ChatMessage, ChatTemplate, ChatTemplateError};
use serde_json::{Map, Value};

const QWEN3_TEMPLATE: &str = r###"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"###;

const XML_TOOLS_TEMPLATE: &str = r###"{%- macro render_extra_keys(json_dict, handled_keys) %}
    {%- if json_dict is mapping %}
        {%- for json_key in json_dict if json_key not in handled_keys %}
            {%- if json_dict[json_key] is mapping or (json_dict[json_key] is sequence and json_dict[json_key] is not string) %}
                {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe) ~ '</' ~ json_key ~ '>' }}
            {%- else %}
                {{-'\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string) ~ '</' ~ json_key ~ '>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools is defined and tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
        {%- if tool.description is defined %}
            {{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}
        {%- endif %}
        {{- '\n<parameters>' }}
        {%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined and tool.parameters.properties is mapping %}
            {%- for param_name, param_fields in tool.parameters.properties|items %}
                {{- '\n<parameter>' }}
                {{- '\n<name>' ~ param_name ~ '</name>' }}
                {%- if param_fields.type is defined %}
                    {{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' }}
                {%- endif %}
                {%- if param_fields.description is defined %}
                    {{- '\n<description>' ~ (param_fields.description | trim) ~ '</description>' }}
                {%- endif %}
                {{- render_extra_keys(param_fields, ['name', 'type', 'description']) }}
                {{- '\n</parameter>' }}
            {%- endfor %}
        {%- endif %}
        {{- render_extra_keys(tool.parameters, ['type', 'properties']) }}
        {{- '\n</parameters>\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {%- if system_message %}
        {{- '\n\n' + system_message }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif system_message %}
    {{- '<|im_start|>system\n' + system_message + '<|im_end|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- '\n' + message.content | trim + '\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined and tool_call.arguments is string %}
                {{- tool_call.arguments ~ '\n' }}
            {%- elif tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "user" or message.role == "system" or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user\n' }}
        {%- endif %}
        {{- '<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>\n' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"###;

/// Conversations: messages, tools, add_generation_prompt and extra keyword arguments.
const CASES_JSON: &str = r###"{
 "tools_reasoning_history": {
  "messages": [
   {
    "role": "system",
    "content": "You are terse."
   },
   {
    "role": "user",
    "content": "Weather in Paris?"
   },
   {
    "role": "assistant",
    "content": "",
    "reasoning_content": "\nNeed the tool.\n",
    "tool_calls": [
     {
      "type": "function",
      "function": {
       "name": "get_weather",
       "arguments": {
        "city": "Paris",
        "unit": "celsius",
        "days": 2,
        "hourly": false,
        "extra": {
         "x": [
          1,
          2.5,
          null
         ]
        }
       }
      }
     },
     {
      "type": "function",
      "function": {
       "name": "now",
       "arguments": "{}"
      }
     }
    ]
   },
   {
    "role": "tool",
    "content": "{\"temp\": 21}"
   },
   {
    "role": "tool",
    "content": "12:00"
   },
   {
    "role": "assistant",
    "content": "<think>\nThe tool said 21.\n</think>\n\nIt is 21°C."
   },
   {
    "role": "user",
    "content": "Thanks! And tomorrow?"
   }
  ],
  "tools": [
   {
    "type": "function",
    "function": {
     "name": "get_weather",
     "description": "Current weather for a city.\n",
     "parameters": {
      "type": "object",
      "properties": {
       "city": {
        "type": "string",
        "description": "City name, e.g. \"Paris\" or 東京"
       },
       "unit": {
        "type": "string",
        "enum": [
         "celsius",
         "fahrenheit"
        ],
        "default": "celsius"
       },
       "days": {
        "type": "integer",
        "minimum": 1,
        "maximum": 7.5
       }
      },
      "required": [
       "city"
      ]
     }
    }
   },
   {
    "type": "function",
    "function": {
     "name": "now",
     "description": "Time now",
     "parameters": {
      "type": "object",
      "properties": {}
     }
    }
   }
  ],
  "add_generation_prompt": true
 },
 "no_tools_thinking_off": {
  "messages": [
   {
    "role": "user",
    "content": "Hi"
   },
   {
    "role": "assistant",
    "content": "<think>greet</think>Hello!"
   },
   {
    "role": "user",
    "content": "Bye"
   }
  ],
  "add_generation_prompt": true,
  "enable_thinking": false
 },
 "last_assistant_after_tool": {
  "messages": [
   {
    "role": "system",
    "content": "S"
   },
   {
    "role": "user",
    "content": "Q"
   },
   {
    "role": "assistant",
    "content": "calling",
    "tool_calls": [
     {
      "function": {
       "name": "now",
       "arguments": {}
      }
     }
    ]
   },
   {
    "role": "tool",
    "content": "noon"
   },
   {
    "role": "assistant",
    "content": "It is noon.",
    "reasoning_content": "Tool answered."
   }
  ],
  "tools": [
   {
    "type": "function",
    "function": {
     "name": "get_weather",
     "description": "Current weather for a city.\n",
     "parameters": {
      "type": "object",
      "properties": {
       "city": {
        "type": "string",
        "description": "City name, e.g. \"Paris\" or 東京"
       },
       "unit": {
        "type": "string",
        "enum": [
         "celsius",
         "fahrenheit"
        ],
        "default": "celsius"
       },
       "days": {
        "type": "integer",
        "minimum": 1,
        "maximum": 7.5
       }
      },
      "required": [
       "city"
      ]
     }
    }
   },
   {
    "type": "function",
    "function": {
     "name": "now",
     "description": "Time now",
     "parameters": {
      "type": "object",
      "properties": {}
     }
    }
   }
  ],
  "add_generation_prompt": false
 }
}"###;

/// Expected prompts, keyed "template/case".
const EXPECTED_JSON: &str = r###"{
 "qwen3/tools_reasoning_history": "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Current weather for a city.\\n\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"description\": \"City name, e.g. \\\"Paris\\\" or 東京\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"], \"default\": \"celsius\"}, \"days\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 7.5}}, \"required\": [\"city\"]}}}\n{\"type\": \"function\", \"function\": {\"name\": \"now\", \"description\": \"Time now\", \"parameters\": {\"type\": \"object\", \"properties\": {}}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\", \"days\": 2, \"hourly\": false, \"extra\": {\"x\": [1, 2.5, null]}}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\nIt is 21°C.<|im_end|>\n<|im_start|>user\nThanks! And tomorrow?<|im_end|>\n<|im_start|>assistant\n",
 "qwen3/no_tools_thinking_off": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
 "qwen3/last_assistant_after_tool": "<|im_start|>system\nS\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Current weather for a city.\\n\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"description\": \"City name, e.g. \\\"Paris\\\" or 東京\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"], \"default\": \"celsius\"}, \"days\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 7.5}}, \"required\": [\"city\"]}}}\n{\"type\": \"function\", \"function\": {\"name\": \"now\", \"description\": \"Time now\", \"parameters\": {\"type\": \"object\", \"properties\": {}}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\ncalling\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nTool answered.\n</think>\n\nIt is noon.<|im_end|>\n",
 "xmltools/tools_reasoning_history": "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n<function>\n<name>get_weather</name>\n<description>Current weather for a city.</description>\n<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n<description>City name, e.g. \"Paris\" or 東京</description>\n</parameter>\n<parameter>\n<name>unit</name>\n<type>string</type>\n<enum>[\"celsius\", \"fahrenheit\"]</enum>\n<default>celsius</default>\n</parameter>\n<parameter>\n<name>days</name>\n<type>integer</type>\n<minimum>1</minimum>\n<maximum>7.5</maximum>\n</parameter>\n<required>[\"city\"]</required>\n</parameters>\n</function>\n<function>\n<name>now</name>\n<description>Time now</description>\n<parameters>\n</parameters>\n</function>\n</tools>\n\nYou are terse.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=hourly>\nFalse\n</parameter>\n<parameter=extra>\n{\"x\": [1, 2.5, null]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n{}\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n12:00\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n<think>\nThe tool said 21.\n</think>\n\nIt is 21°C.<|im_end|>\n<|im_start|>user\nThanks! And tomorrow?<|im_end|>\n<|im_start|>assistant\n",
 "xmltools/no_tools_thinking_off": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>greet</think>Hello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
 "xmltools/last_assistant_after_tool": "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n<function>\n<name>get_weather</name>\n<description>Current weather for a city.</description>\n<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n<description>City name, e.g. \"Paris\" or 東京</description>\n</parameter>\n<parameter>\n<name>unit</name>\n<type>string</type>\n<enum>[\"celsius\", \"fahrenheit\"]</enum>\n<default>celsius</default>\n</parameter>\n<parameter>\n<name>days</name>\n<type>integer</type>\n<minimum>1</minimum>\n<maximum>7.5</maximum>\n</parameter>\n<required>[\"city\"]</required>\n</parameters>\n</function>\n<function>\n<name>now</name>\n<description>Time now</description>\n<parameters>\n</parameters>\n</function>\n</tools>\n\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\ncalling\n\n<tool_call>\n<function=now>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nnoon\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\nIt is noon.<|im_end|>\n"
}"###;

fn render_case(template: &ChatTemplate, case: &Value) -> Result<String, ChatTemplateError> {
    let messages: Vec<ChatMessage> =
        serde_json::from_value(case["messages"].clone()).expect("messages");
    let add_generation_prompt = case["add_generation_prompt"]
        .as_bool()
        .expect("add_generation_prompt");
    let mut kwargs = Map::new();
    for (key, value) in case.as_object().expect("case object") {
        if key != "messages" && key != "add_generation_prompt" {
            kwargs.insert(key.clone(), value.clone());
        }
    }
    template.render(&messages, add_generation_prompt, &kwargs)
}

#[test]
fn qwen_style_templates_render_like_jinja2() {
    let cases: Value = serde_json::from_str(CASES_JSON).expect("cases");
    let expected: Value = serde_json::from_str(EXPECTED_JSON).expect("expected");
    let expected = expected.as_object().expect("expected object");
    let mut checked = 0;
    for (template_name, source) in [("qwen3", QWEN3_TEMPLATE), ("xmltools", XML_TOOLS_TEMPLATE)] {
        let template = ChatTemplate::new(source).expect("template compiles");
        for (case_name, case) in cases.as_object().expect("cases object") {
            let key = format!("{template_name}/{case_name}");
            let want = expected[&key].as_str().expect("expected prompt");
            let got = render_case(&template, case).unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(got, want, "{key}");
            checked += 1;
        }
    }
    assert_eq!(checked, 6);
}

#[test]
fn xml_tools_template_rejects_unknown_roles() {
    let template = ChatTemplate::new(XML_TOOLS_TEMPLATE).expect("template compiles");
    let err = template
        .render(&[ChatMessage::new("narrator", "x")], true, &Map::new())
        .unwrap_err();
    assert!(
        matches!(&err, ChatTemplateError::Raised(m) if m == "Unexpected message role: narrator"),
        "{err}"
    );
    let err = template.render(&[], true, &Map::new()).unwrap_err();
    assert!(
        matches!(&err, ChatTemplateError::Raised(m) if m == "No messages provided."),
        "{err}"
    );
}

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

const QWEN3_TEMPLATE: &str = include_str!("data/qwen3_chat_template.jinja");

const XML_TOOLS_TEMPLATE: &str = include_str!("data/xml_tools_chat_template.jinja");

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

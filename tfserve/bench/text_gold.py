"""Gold sets for the text layer's choices: sentence boundaries per language (SENTENCES) and
the language of short and long sentences (LANGUAGES). Written for tfserve (the sentences are
ours), small on purpose: each case is one thing a segmenter or detector gets right or wrong.
tfserve/bench/segmenters.py and tfserve/bench/language_detectors.py score candidates on them;
tests/text/test_segmentation.py and test_language_detection.py hold the chosen ones to them.
"""

from __future__ import annotations

# language -> cases: (text, its sentences in order)
SENTENCES: dict[str, list[tuple[str, list[str]]]] = {
    "en": [
        ("Dr. Smith arrived at 10 a.m. today. He was late.",
         ["Dr. Smith arrived at 10 a.m. today.", "He was late."]),
        ("Pi is about 3.14. That is enough.", ["Pi is about 3.14.", "That is enough."]),
        ("Bring fruit, e.g. apples or pears. Then leave.",
         ["Bring fruit, e.g. apples or pears.", "Then leave."]),
        ('He said "Stop!" She did not. Why?', ['He said "Stop!"', "She did not.", "Why?"]),
        ("Wait... What happened? Nothing.", ["Wait...", "What happened?", "Nothing."]),
        ("See https://example.com/a.b for details. It is free.",
         ["See https://example.com/a.b for details.", "It is free."]),
        ("Mr. and Mrs. Jones live in the U.S. with their kids. They like it.",
         ["Mr. and Mrs. Jones live in the U.S. with their kids.", "They like it."]),
        ("The price rose 2.5% in Jan. 2020. Analysts were surprised.",
         ["The price rose 2.5% in Jan. 2020.", "Analysts were surprised."]),
        ("I love it! Don't you?", ["I love it!", "Don't you?"]),
        ("Version 1.2.3 is out. Update now.", ["Version 1.2.3 is out.", "Update now."]),
    ],
    "fr": [
        ("M. Dupont est arrivé. Il est content.", ["M. Dupont est arrivé.", "Il est content."]),
        ("Il fait 3,5 degrés. C'est froid !", ["Il fait 3,5 degrés.", "C'est froid !"]),
        ("« Viens ici ! » dit-elle. Il vint.", ["« Viens ici ! » dit-elle.", "Il vint."]),
        ("Voir p. 12 du rapport. Merci.", ["Voir p. 12 du rapport.", "Merci."]),
        ("Quoi ? Vraiment ? Oui.", ["Quoi ?", "Vraiment ?", "Oui."]),
        ("Le Dr Martin habite à Paris, etc. Il travaille beaucoup.",
         ["Le Dr Martin habite à Paris, etc.", "Il travaille beaucoup."]),
    ],
    "de": [
        ("Am 3. Oktober feiern wir. Es ist ein Feiertag.",
         ["Am 3. Oktober feiern wir.", "Es ist ein Feiertag."]),
        ("Das ist z. B. gut. Wir gehen.", ["Das ist z. B. gut.", "Wir gehen."]),
        ("Herr Dr. Müller kommt. Er ist Arzt.", ["Herr Dr. Müller kommt.", "Er ist Arzt."]),
        ("Es kostet 4,99 Euro. Das ist billig!", ["Es kostet 4,99 Euro.", "Das ist billig!"]),
        ("Wie bitte? Ich verstehe nicht.", ["Wie bitte?", "Ich verstehe nicht."]),
        ("Die Firma usw. ist bekannt. Sie wächst.",
         ["Die Firma usw. ist bekannt.", "Sie wächst."]),
    ],
    "es": [
        ("¿Dónde estás? Estoy en casa.", ["¿Dónde estás?", "Estoy en casa."]),
        ("¡Qué bien! Vamos a la playa.", ["¡Qué bien!", "Vamos a la playa."]),
        ("El Sr. García llegó. Estaba cansado.", ["El Sr. García llegó.", "Estaba cansado."]),
        ("Cuesta 3,50 euros. Es barato.", ["Cuesta 3,50 euros.", "Es barato."]),
        ("La Dra. López trabaja aquí. Es muy buena.",
         ["La Dra. López trabaja aquí.", "Es muy buena."]),
    ],
    "ru": [
        ("Привет! Как дела?", ["Привет!", "Как дела?"]),
        ("Это стоит 3,5 рубля. Дёшево.", ["Это стоит 3,5 рубля.", "Дёшево."]),
        ("В 2020 г. всё изменилось. Мы остались дома.",
         ["В 2020 г. всё изменилось.", "Мы остались дома."]),
        ("Я видел А. С. Пушкина. Шутка.", ["Я видел А. С. Пушкина.", "Шутка."]),
        ("Он сказал: «Нет». Мы ушли.", ["Он сказал: «Нет».", "Мы ушли."]),
    ],
    "zh": [
        ("你好。我很好！你呢？", ["你好。", "我很好！", "你呢？"]),
        ("今天天气很好。我们去公园吧。", ["今天天气很好。", "我们去公园吧。"]),
        ("价格是3.14元。太便宜了！", ["价格是3.14元。", "太便宜了！"]),
        ("他说：“我来了。”然后走了。", ["他说：“我来了。”", "然后走了。"]),
        ("真的吗？是的。", ["真的吗？", "是的。"]),
    ],
    "ja": [
        ("こんにちは。元気ですか？", ["こんにちは。", "元気ですか？"]),
        ("今日は晴れです！散歩に行きましょう。", ["今日は晴れです！", "散歩に行きましょう。"]),
        ("値段は3.5ドルです。安いです。", ["値段は3.5ドルです。", "安いです。"]),
        ("「行こう。」と彼は言った。私も行った。", ["「行こう。」と彼は言った。", "私も行った。"]),
    ],
    "th": [
        # Thai writes no sentence punctuation: a space ends a sentence (and a phrase)
        ("วันนี้อากาศดีมาก เราไปเที่ยวทะเลกัน", ["วันนี้อากาศดีมาก", "เราไปเที่ยวทะเลกัน"]),
        ("ฉันชอบกินข้าว คุณชอบกินอะไร", ["ฉันชอบกินข้าว", "คุณชอบกินอะไร"]),
        ("สวัสดีครับ ผมชื่อสมชาย ยินดีที่ได้รู้จัก",
         ["สวัสดีครับ", "ผมชื่อสมชาย", "ยินดีที่ได้รู้จัก"]),
    ],
    "ar": [
        ("ذهبت إلى البيت. هل أتيت؟ نعم.", ["ذهبت إلى البيت.", "هل أتيت؟", "نعم."]),
        ("الطقس جميل اليوم! لنذهب إلى الحديقة.", ["الطقس جميل اليوم!", "لنذهب إلى الحديقة."]),
        ("السعر 3.5 دولار. هذا رخيص.", ["السعر 3.5 دولار.", "هذا رخيص."]),
    ],
    "hi": [
        ("मैं घर गया। वह आया।", ["मैं घर गया।", "वह आया।"]),
        ("क्या तुम आओगे? हाँ, ज़रूर!", ["क्या तुम आओगे?", "हाँ, ज़रूर!"]),
        ("डॉ. शर्मा यहाँ हैं। वे डॉक्टर हैं।", ["डॉ. शर्मा यहाँ हैं।", "वे डॉक्टर हैं।"]),
    ],
}

# (ISO 639-1 code, text): short texts (a few words) and long ones (a sentence or two)
LANGUAGES: dict[str, list[tuple[str, str]]] = {
    "short": [
        ("en", "Where is the station?"), ("fr", "Où est la gare ?"),
        ("de", "Wo ist der Bahnhof?"), ("es", "¿Dónde está la estación?"),
        ("it", "Dov'è la stazione?"), ("pt", "Onde fica a estação?"),
        ("nl", "Waar is het station?"), ("ru", "Где вокзал?"), ("zh", "火车站在哪里？"),
        ("ja", "駅はどこですか？"), ("ar", "أين المحطة؟"), ("hi", "स्टेशन कहाँ है?"),
        ("en", "Thank you very much"), ("fr", "Merci beaucoup"), ("de", "Vielen Dank"),
        ("es", "Muchas gracias"), ("it", "Grazie mille"), ("pt", "Muito obrigado"),
        ("nl", "Hartelijk dank"), ("ru", "Большое спасибо"), ("zh", "非常感谢"),
        ("ja", "ありがとうございます"), ("ar", "شكرا جزيلا"), ("hi", "बहुत धन्यवाद"),
        ("en", "I am hungry"), ("fr", "J'ai faim"), ("de", "Ich habe Hunger"),
        ("es", "Tengo hambre"), ("it", "Ho fame"), ("pt", "Estou com fome"),
        ("nl", "Ik heb honger"), ("ru", "Я голоден"), ("zh", "我饿了"), ("ja", "お腹が空いた"),
        ("ar", "أنا جائع"), ("hi", "मुझे भूख लगी है"),
    ],
    "long": [
        ("en", "The committee will meet next week to discuss the budget for the coming year "
               "and to decide which projects deserve more funding."),
        ("fr", "Le comité se réunira la semaine prochaine pour discuter du budget de l'année "
               "à venir et décider quels projets méritent davantage de financement."),
        ("de", "Der Ausschuss wird sich nächste Woche treffen, um den Haushalt für das "
               "kommende Jahr zu besprechen und zu entscheiden, welche Projekte mehr Geld "
               "verdienen."),
        ("es", "El comité se reunirá la próxima semana para discutir el presupuesto del año "
               "que viene y decidir qué proyectos merecen más financiación."),
        ("it", "Il comitato si riunirà la prossima settimana per discutere il bilancio "
               "dell'anno prossimo e decidere quali progetti meritano più fondi."),
        ("pt", "O comitê se reunirá na próxima semana para discutir o orçamento do próximo "
               "ano e decidir quais projetos merecem mais financiamento."),
        ("nl", "De commissie komt volgende week bijeen om de begroting voor het komende jaar "
               "te bespreken en te beslissen welke projecten meer geld verdienen."),
        ("ru", "Комитет соберётся на следующей неделе, чтобы обсудить бюджет на следующий "
               "год и решить, какие проекты заслуживают большего финансирования."),
        ("zh", "委员会将于下周开会，讨论明年的预算，并决定哪些项目值得获得更多资金。"),
        ("ja", "委員会は来週会合を開き、来年度の予算について話し合い、どのプロジェクトが"
               "より多くの資金に値するかを決定します。"),
        ("ar", "ستجتمع اللجنة الأسبوع المقبل لمناقشة ميزانية العام القادم وتحديد المشاريع "
               "التي تستحق المزيد من التمويل."),
        ("hi", "समिति अगले सप्ताह आने वाले वर्ष के बजट पर चर्चा करने और यह तय करने के लिए "
               "बैठक करेगी कि किन परियोजनाओं को अधिक धन मिलना चाहिए।"),
        ("th", "คณะกรรมการจะประชุมกันในสัปดาห์หน้าเพื่อหารือเกี่ยวกับงบประมาณของปีหน้า"),
        ("ko", "위원회는 다음 주에 모여 내년 예산을 논의하고 어떤 프로젝트가 더 많은 자금을 "
               "받을 자격이 있는지 결정할 것입니다."),
    ],
}

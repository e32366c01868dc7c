"""Small, varied HL7 v2 messages shared by the spark_jobs tests (synthetic data, no PHI)."""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import LongType, StringType, StructField, StructType

# Default separators, CR endings; PID-3 repeats, PID-3[2].4 has subcomponents, PV1-10 is HL7 "".
ADT_A01 = (
    "MSH|^~\\&|ADT1|GOOD HEALTH HOSPITAL|EHR|CITY|20240101120000||ADT^A01^ADT_A01|MSG00001|P|2.5.1\r"
    "EVN|A01|20240101120000\r"
    "PID|1||PATID1234^^^GOOD HEALTH HOSPITAL^MR~123456789^^^USSSA&2.16.840.1.113883.4.1&ISO^SS||"
    "EVERYMAN^ADAM^A^III||19610615|M|||2222 HOME STREET^^GREENSBORO^NC^27401-1020\r"
    "NK1|1|JONES^BARBARA^K|SPO^Spouse^HL70063\r"
    'PV1|1|I|2000^2012^01||||004777^ATTEND^AARON^A|||""\r'
    "ZPI|1|loyalty^GOLD\r"
)

# Several OBX; escape sequences in PID-6, NTE-3 and OBX[3]-5.
ORU_R01 = (
    "MSH|^~\\&|LAB|LABFAC|EHR|CITY|20240102083000||ORU^R01^ORU_R01|MSG00002|P|2.5.1\r"
    "PID|1||555^^^LAB^MR||PATIENT^PAT|See \\F\\ note\\S\\1\\T\\2\\R\\3\\E\\ end\r"
    "OBR|1|ORD1|FIL1|24331-1^Lipid panel^LN\r"
    "OBX|1|NM|2093-3^Cholesterol^LN||196|mg/dL|<200|N|||F\r"
    "OBX|2|NM|2571-8^Triglyceride^LN||90|mg/dL|<150|N|||F\r"
    "OBX|3|ST|NOTE^Comment^L||C:\\E\\temp\\E\\x||||||F\r"
    "NTE|1||fasting 12h \\E\\F\\E\\ \\H\\bold\\N\\ 50\\ pct\r"
)

# LF segment endings.
ORM_O01 = (
    "MSH|^~\\&|CPOE|HOSP|RIS|HOSP|20240103101500||ORM^O01|MSG00003|P|2.3\n"
    "PID|1||777^^^HOSP^MR||ROE^RICHARD\n"
    "PV1|1|O\n"
    "ORC|NW|ORD777\n"
    "OBR|1|ORD777||71020^CHEST XRAY 2V^CPT\n"
)

# Two patients' results in one message (ORU^R01's PATIENT_RESULT repeats): the second with a next
# of kin, an NTE after its OBR (the IG maps none) and its hemoglobin.
ORU_R01_TWO_PATIENTS = (
    "MSH|^~\\&|LAB|LABFAC|EHR|CITY|20240105090000||ORU^R01^ORU_R01|MSG00010|P|2.5.1\r"
    "PID|1||555^^^LAB^MR||PATIENT^PAT\r"
    "OBR|1|ORD1|FIL1|24331-1^Lipid panel^LN|||20240105080000\r"
    "OBX|1|NM|2093-3^Cholesterol^LN||196|mg/dL^^UCUM|<200|N|||F\r"
    "NTE|1||fasting 12h\r"
    "PID|2||556^^^LAB^MR||OTHER^BETTY||19800202|F\r"
    "NK1|1|OTHER^BOB|SPO^Spouse^HL70063||^PRN^PH^^^555^7654321\r"
    "OBR|1|ORD2|FIL2|58410-2^CBC panel^LN|||20240105081500\r"
    "NTE|1||hemolyzed sample, redrawn\r"
    "OBX|1|NM|718-7^Hemoglobin^LN||9.1|g/dL^^UCUM|12.0-16.0|L|||F\r"
    "OBX|2|NM|6690-2^Leukocytes^LN||7.5|10*3/uL^^UCUM|4.5-11.0|N|||F\r"
)

# Two patients' orders (a PID before each ORDER group), the first with two order notes (NTE after its OBR).
ORM_O01_TWO_PATIENTS = (
    "MSH|^~\\&|CPOE|HOSP|RIS|HOSP|20240106101500||ORM^O01|MSG00011|P|2.3\r"
    "PID|1||777^^^HOSP^MR||ROE^RICHARD\r"
    "ORC|NW|ORD777^HOSP|||SC||^^^^^R||20240106101000\r"
    "OBR|1|ORD777^HOSP||71020^CHEST XRAY 2V^CPT\r"
    "NTE|1||patient on oxygen\r"
    "NTE|2||portable \\T\\ bedside if possible\r"
    "PID|2||778^^^HOSP^MR||DOE^JANE\r"
    "ORC|NW|ORD778^HOSP|||||^^^^^S\r"
    "OBR|1|ORD778^HOSP||74150^CT ABDOMEN^CPT\r"
)

# The next three share one PID layout under different separators (CRLF endings on the first):
# PID-3 = two repetitions, component 3 has two subcomponents; PID-5 has a default separator as
# plain text; PID-6 holds field and component separator escapes.
CUSTOM_HASH = (  # field '#', component '*'
    "MSH#*~\\&#LEGACY#FAC#EHR#CITY#20240104##ADT*A08#MSG00004#P#2.3\r\n"
    "PID#1##42*^*x&y~43***ALT##DOE|JR*JOHN#A\\F\\B\\S\\C\r\n"
)
REGEX_HOSTILE = (  # field '*', component '$', repetition '+', escape '?', subcomponent '.'
    "MSH*$+?.*APP*FAC*EHR*CITY*20240105**ORU$R01*MSG00005*P*2.5\rPID*1**42$|$x.y+43$$$ALT**DOE^JR$JOHN*A?F?B?S?C\r"
)
NO_SUBCOMPONENT = (  # MSH-2 is only "^~\": '&' is plain text, \T\ has nothing to decode to
    "MSH|^~\\|APP|FAC|EHR|CITY|20240106||ADT^A04|MSG00006|P|2.3\r"
    "PID|1||42^*^x&y~43^^^ALT||DOE#JR^JOHN|A\\F\\B\\S\\C\\T\\D\r"
)

NOT_HL7 = "this is not an HL7 message"

CORPUS: dict[int, str | None] = {
    1: ADT_A01,
    2: ORU_R01,
    3: ORM_O01,
    4: CUSTOM_HASH,
    5: REGEX_HOSTILE,
    6: NO_SUBCOMPONENT,
    7: NOT_HL7,
    8: None,
}


def messages(spark: SparkSession, *ids: int, extra: dict[int, str | None] | None = None) -> DataFrame:
    """An ``id``/``payload`` frame of the given corpus entries (plus ad-hoc ``extra`` ones)."""
    source = {**CORPUS, **(extra or {})}
    schema = StructType([StructField("id", LongType()), StructField("payload", StringType())])
    return spark.createDataFrame([(i, source[i]) for i in ids], schema)


def frame(spark: SparkSession, columns: list[str], rows: list[tuple]) -> DataFrame:
    """An expected frame: ``id`` (long) followed by string columns."""
    fields = [StructField(columns[0], LongType())] + [StructField(c, StringType()) for c in columns[1:]]
    return spark.createDataFrame(rows, StructType(fields))

;;;; The request and reply objects of a request the engine answers.
;;;;
;;;; Both are made by constructors compiled once per START for the
;;;; acceptor's classes: PARALLEL-REQUEST and PARALLEL-REPLY where the
;;;; acceptor names Hunchentoot's own, so that the engine's behaviour is
;;;; attached to classes of ours, never to Hunchentoot's.  When the request
;;;; class is a PARALLEL-REQUEST initialized as Hunchentoot's own request is
;;;; (no INITIALIZE-INSTANCE or SHARED-INITIALIZE method of its own), a
;;;; request whose target needs no decoding is made without Hunchentoot's
;;;; initializer: its slots are set from the head, the script name and query
;;;; string are cut from the URI, the GET parameters and cookies are left to
;;;; be parsed on first use (by the SLOT-UNBOUND methods below), and the
;;;; session is looked up only when the request could name one.  Every
;;;; accessor then returns what Hunchentoot's initializer would have
;;;; computed.  A PARALLEL-REPLY initialized as Hunchentoot's reply is is
;;;; made the same way, its Content-Type set as that initializer sets it,
;;;; while (SETF HUNCHENTOOT:HEADER-OUT), which it calls, has only
;;;; Hunchentoot's methods.  Both honour the class's default initargs.  Any
;;;; other request or reply, of any other class, goes through MAKE-INSTANCE
;;;; and Hunchentoot's initializer, unchanged.

(in-package #:hunchentoot-recycling-taskmaster)

(defclass parallel-request (hunchentoot:request)
  ()
  (:documentation "The request class a parallel acceptor uses where its
HUNCHENTOOT:ACCEPTOR-REQUEST-CLASS is Hunchentoot's default, HUNCHENTOOT:REQUEST.
Its HUNCHENTOOT:PROCESS-REQUEST writes the common reply as octets
(engine/serving/reply.lisp); its requests may be made without Hunchentoot's
initializer.  A :REQUEST-CLASS of your own gets both by inheriting from
this class; one that does not is served by Hunchentoot's own
PROCESS-REQUEST and initializer, as on Hunchentoot's acceptor."))

(defclass parallel-reply (hunchentoot:reply)
  ()
  (:documentation "The reply class a parallel acceptor uses where its
HUNCHENTOOT:ACCEPTOR-REPLY-CLASS is Hunchentoot's default, HUNCHENTOOT:REPLY."))

(defun ours-in-place-of (class hunchentoot-default ours)
  "CLASS (a class or its name), or OURS when CLASS is HUNCHENTOOT-DEFAULT."
  (if (member class (list hunchentoot-default (find-class hunchentoot-default)))
      ours
      class))

(defun engine-request-class (acceptor)
  "The class of the requests the engine makes for ACCEPTOR: its
HUNCHENTOOT:ACCEPTOR-REQUEST-CLASS, PARALLEL-REQUEST in place of
HUNCHENTOOT:REQUEST.  Not a default initarg of the parallel acceptors: a
mixin's own default (hunchensocket's, say) must win whichever side of ours
it is listed on, as it does beside Hunchentoot's acceptor."
  (ours-in-place-of (hunchentoot:acceptor-request-class acceptor) 'hunchentoot:request 'parallel-request))

(defun engine-reply-class (acceptor)
  "The class of ACCEPTOR's replies: its HUNCHENTOOT:ACCEPTOR-REPLY-CLASS,
PARALLEL-REPLY in place of HUNCHENTOOT:REPLY."
  (ours-in-place-of (hunchentoot:acceptor-reply-class acceptor) 'hunchentoot:reply 'parallel-reply))

(defmethod slot-unbound (class (request parallel-request) (slot-name (eql 'hunchentoot:get-parameters)))
  "The engine's request constructor leaves a query string it could parse
without error unparsed: parse it on first use."
  (declare (ignore class))
  (setf (slot-value request slot-name) (parse-query-string (hunchentoot:query-string request))))

(defun request-cookies (headers)
  "The cookies of a request with HEADERS, as its constructor sets them: its
Cookie header's fields (COOKIE-HEADER-FIELDS), or :UNPARSED when that header
is left to Hunchentoot's reading (on first use, which answers an error with
400 as Hunchentoot's initializer does)."
  (let ((header (cdr (assoc :cookie headers))))
    (if header
        (let ((fields (cookie-header-fields header)))
          (if (eq fields :irregular) :unparsed fields))
        '())))

(defmethod slot-unbound (class (request parallel-request) (slot-name (eql 'hunchentoot:cookies-in)))
  "The engine's request constructor leaves an irregular Cookie header
unparsed: parse it on first use, as Hunchentoot's initializer does."
  (declare (ignore class))
  (setf (slot-value request slot-name)
        (parse-cookie-header (cdr (assoc :cookie (hunchentoot:headers-in request))))))

(defstruct (object-constructors
            (:constructor %make-object-constructors
                (request plain-request cookie-only-session-verify-p plus-is-space-p reply plain-reply)))
  "The functions that make an acceptor's request and reply objects."
  ;; Makes a request through MAKE-INSTANCE, with Hunchentoot's initializer.
  (request nil :type function :read-only t)
  ;; Makes a request from its head and the fields cut from its URI, without
  ;; Hunchentoot's initializer; NIL when the request class has initialization
  ;; methods of its own.
  (plain-request nil :type (or null function) :read-only t)
  ;; True when HUNCHENTOOT:SESSION-VERIFY of a request is Hunchentoot's or
  ;; ours (SESSION-VERIFY-READS-COOKIE-ONLY-P), which find no session unless
  ;; the session cookie name is in the Cookie header or the query string.
  (cookie-only-session-verify-p nil :read-only t)
  ;; True when the loaded Hunchentoot's initializer reads a + in a request's
  ;; path as a space: 1.2 does, 1.3.0 stopped.
  (plus-is-space-p t :read-only t)
  ;; Makes a reply through MAKE-INSTANCE, with Hunchentoot's initializer.
  (reply nil :type function :read-only t)
  ;; Makes a reply without Hunchentoot's initializer's generic function
  ;; calls (PLAIN-REPLY-CONSTRUCTOR-FORM); NIL when the reply class has
  ;; initialization methods of its own.
  (plain-reply nil :type (or null function) :read-only t))

(defparameter *request-initargs*
  '((:acceptor . acceptor) (:local-addr . local-addr) (:local-port . local-port)
    (:remote-addr . remote-addr) (:remote-port . remote-port) (:headers-in . headers-in)
    (:content-stream . content-stream) (:method . method) (:uri . uri)
    (:server-protocol . protocol))
  "Each initarg the engine makes a request with, and the variable holding
its value in a constructor.")

(defun initialized-as-hunchentoot-p (class ours hunchentoot-initializer)
  "True when CLASS is a standard class inheriting from OURS and making an
instance of it runs no initialization method but the standard ones and
HUNCHENTOOT-INITIALIZER, so that setting its slots and doing what that
initializer does makes the same object."
  (flet ((standard-or-hunchentoot-p (methods)
           (and (listp methods)
                (every (lambda (method)
                         (or (eq method hunchentoot-initializer)
                             (let ((specializer (method-specializer method)))
                               (and (typep specializer 'class)
                                    (subtypep (find-class 'standard-object) specializer)))))
                       methods))))
    (and (standard-class-p class)
         (subtypep class ours)
         (standard-or-hunchentoot-p (applicable-methods #'initialize-instance class))
         (standard-or-hunchentoot-p (applicable-methods #'shared-initialize class (find-class 'symbol))))))

(defun initialized-as-hunchentoot-request-p (class)
  "True when a request of CLASS may be made without Hunchentoot's request
initializer (INITIALIZED-AS-HUNCHENTOOT-P)."
  (initialized-as-hunchentoot-p class 'parallel-request (request-initializer-method)))

(defun initialized-as-hunchentoot-reply-p (class)
  "True when a reply of CLASS may be made without Hunchentoot's reply
initializer (INITIALIZED-AS-HUNCHENTOOT-P)."
  (initialized-as-hunchentoot-p class 'parallel-reply (reply-initializer-method)))

(defun slot-initialization-form (slot class value-variable)
  "A form setting SLOT, an INSTANCE-SLOT of CLASS, of the instance in the
variable INSTANCE as MAKE-INSTANCE would: to the value of the variable
VALUE-VARIABLE names when it names one (a value given with an initarg), else
to CLASS's default initarg for it, else to its initform; NIL when the slot
stays unbound."
  (let ((location (instance-slot-location slot))
        (default-initarg-function (default-initarg-function class slot))
        (initform (instance-slot-initform slot))
        (initfunction (instance-slot-initfunction slot)))
    (cond (value-variable
           `(setf (instance-slot-value instance ,location) ,value-variable))
          (default-initarg-function
           `(setf (instance-slot-value instance ,location) (funcall ,default-initarg-function)))
          ((and initfunction (constantp initform))
           `(setf (instance-slot-value instance ,location) ',(eval initform)))
          (initfunction
           `(setf (instance-slot-value instance ,location) (funcall ,initfunction))))))

(defparameter *request-field-variables*
  '((:script-name . script-name) (:query-string . query-string)
    (:get-parameters . get-parameters) (:cookies-in . cookies-in))
  "Each field of a request that the engine cuts from its head in place of
Hunchentoot's initializer (see REQUEST-SLOT-ROLE), and the variable holding
it in a constructor.")

(defun plain-request-constructor-form (class)
  "A lambda making an instance of CLASS from the head's fields (the
variables of +REQUEST-INITARGS+), SCRIPT-NAME, QUERY-STRING, GET-PARAMETERS
and COOKIES-IN, the last two left unbound when they are :UNPARSED.  Slots
the engine gives no value to get their default initargs or initforms, as
from MAKE-INSTANCE."
  (flet ((slot-form (slot)
           (let* ((initarg-variable (loop for initarg in (instance-slot-initargs slot)
                                          thereis (cdr (assoc initarg *request-initargs*))))
                  (role (request-slot-role (instance-slot-name slot)))
                  (field-variable (cdr (assoc role *request-field-variables*))))
             (if (and (member role '(:get-parameters :cookies-in)) (not initarg-variable))
                 `(unless (eq ,field-variable :unparsed)
                    (setf (instance-slot-value instance ,(instance-slot-location slot)) ,field-variable))
                 (slot-initialization-form slot class (or initarg-variable field-variable))))))
    `(lambda (,@(mapcar #'cdr *request-initargs*) ,@(mapcar #'cdr *request-field-variables*))
       (declare (ignorable ,@(mapcar #'cdr *request-initargs*) ,@(mapcar #'cdr *request-field-variables*)))
       (let ((instance (allocate-instance ,class)))
         ,@(remove nil (mapcar #'slot-form (instance-slots class)))
         instance))))

(defun plain-reply-constructor-form (class)
  "A lambda making an instance of CLASS as MAKE-INSTANCE would, its slots
set as without initargs, and then doing what Hunchentoot's reply
initializer does through (SETF HUNCHENTOOT:HEADER-OUT) with only
Hunchentoot's methods: the Content-Type header and slot set to
HUNCHENTOOT:*DEFAULT-CONTENT-TYPE*.  The lambda returns NIL, having made
nothing, when that value is neither a string nor NIL: Hunchentoot's method
signals then, and MAKE-INSTANCE should."
  `(lambda ()
     (let ((content-type hunchentoot:*default-content-type*))
       (when (typep content-type '(or null string))
         (let ((instance (allocate-instance ,class)))
           ,@(remove nil (mapcar (lambda (slot) (slot-initialization-form slot class nil))
                                 (instance-slots class)))
           (setf (reply-headers instance) (acons :content-type content-type (reply-headers instance))
                 (reply-content-type instance) content-type)
           instance)))))

(defun path-plus-is-space-p (acceptor)
  "True when the loaded Hunchentoot's request initializer makes a space of a
+ in a request's path, asked of the initializer itself for ACCEPTOR."
  (let* ((hunchentoot:*acceptor* acceptor)
         (hunchentoot:*reply* (make-instance 'hunchentoot:reply))
         (hunchentoot:*session* nil)
         (request (make-instance 'hunchentoot:request
                                 :acceptor acceptor :headers-in '() :content-stream nil
                                 :method :get :uri "/+" :server-protocol :http/1.1
                                 :remote-addr "127.0.0.1" :remote-port 0
                                 :local-addr "127.0.0.1" :local-port 0)))
    (equal (hunchentoot:script-name request) "/ ")))

(defun session-verify-reads-cookie-only-p (request-class)
  "True when HUNCHENTOOT:SESSION-VERIFY of a REQUEST-CLASS request is
Hunchentoot's or PARALLEL-REQUEST's (acceptor-sessions.lisp): both find no
session unless the session cookie name is in the Cookie header or the
query string."
  (let ((ours (find-method #'hunchentoot:session-verify '() (list (find-class 'parallel-request)) nil)))
    (every (lambda (method) (member method (list ours (default-session-verify-method))))
           (applicable-methods #'hunchentoot:session-verify request-class))))

(defun make-object-constructors (acceptor)
  "Functions making ACCEPTOR's request and reply objects, compiled once for
its request and reply classes as they are at START: MAKE-INSTANCE of a
class known only at run time looks the class up and conses its initargs
at every call."
  (flet ((compile-quietly (form)
           (handler-bind ((warning #'muffle-warning))
             (compile nil form)))
         (finalized (class-or-name)
           (finalized-class (if (symbolp class-or-name) (find-class class-or-name) class-or-name))))
    (let* ((request-class-name (engine-request-class acceptor))
           (request-class (finalized request-class-name))
           (reply-class-name (engine-reply-class acceptor))
           (reply-class (finalized reply-class-name)))
      (%make-object-constructors
       (compile-quietly
        `(lambda ,(mapcar #'cdr *request-initargs*)
           (make-instance ',request-class-name
                          ,@(loop for (initarg . variable) in *request-initargs*
                                  append (list initarg variable)))))
       (when (initialized-as-hunchentoot-request-p request-class)
         (compile-quietly (plain-request-constructor-form request-class)))
       (session-verify-reads-cookie-only-p request-class)
       (path-plus-is-space-p acceptor)
       (compile-quietly
        `(lambda () (make-instance ',reply-class-name)))
       (when (initialized-as-hunchentoot-reply-p reply-class)
         (compile-quietly (plain-reply-constructor-form reply-class)))))))

(defun make-reply (constructors plain-header-methods-p)
  "A new reply of the class CONSTRUCTORS were made for; without
Hunchentoot's initializer when its class allows and PLAIN-HEADER-METHODS-P
says that (SETF HUNCHENTOOT:HEADER-OUT), which that initializer calls, has
only Hunchentoot's methods, whose effective method took 2% of a 0 ms
request's user time (bench/profiles/2026-11-29-reply-objects-and-closing.txt)."
  (let ((plain-reply (and plain-header-methods-p (object-constructors-plain-reply constructors))))
    (or (and plain-reply (funcall plain-reply))
        (funcall (object-constructors-reply constructors)))))

;;; A request made without Hunchentoot's initializer.

(defun names-charset-p (content-type)
  "True when the Content-Type header value CONTENT-TYPE may have a charset parameter."
  (search "charset" content-type :test #'char-equal))

(defun plain-request-target (uri headers plus-is-space-p)
  "When Hunchentoot's initializer has nothing in URI to decode that could
fail or depend on a charset (no %-escape, no character above 127 in the
path, no charset in HEADERS' Content-Type) and URI is a path (not an
absolute-form target, which it would cut), the script name it makes of URI
(a + read as a space when PLUS-IS-SPACE-P) and its query string (or NIL);
else NIL."
  (declare (type simple-string uri) (optimize speed))
  (let ((content-type (cdr (assoc :content-type headers)))
        (length (length uri))
        (path-end nil)
        (plus-in-path-p nil))
    (when (or (zerop length)
              (char/= (schar uri 0) #\/)
              (and content-type (names-charset-p content-type)))
      (return-from plain-request-target nil))
    (dotimes (index length)
      (let ((character (schar uri index)))
        (cond ((char= character #\%)
               (return-from plain-request-target nil))
              (path-end)
              ((char= character #\?)
               (setf path-end index))
              ((char= character #\+)
               (setf plus-in-path-p t))
              ((> (char-code character) 127)
               (return-from plain-request-target nil)))))
    ;; A target without a query is its own script name, one string where
    ;; Hunchentoot makes two (32 bytes a request, bench/profiles/
    ;; 2026-11-28-per-core.txt); both are only ever read.
    (values (cond ((and plus-is-space-p plus-in-path-p)
                   (nsubstitute #\Space #\+ (subseq uri 0 (or path-end length))))
                  (path-end (subseq uri 0 path-end))
                  (t uri))
            (when path-end
              (subseq uri (1+ path-end))))))

(defun may-name-session-p (session-cookie-name cookie-header query-string)
  "False when neither the Cookie header COOKIE-HEADER nor the query string
QUERY-STRING (without %-escapes) can give a cookie or GET parameter named
SESSION-COOKIE-NAME: Hunchentoot's SESSION-VERIFY then finds no session."
  (or (and cookie-header (string-occurs-p session-cookie-name cookie-header))
      (and query-string
           (or (find #\Space session-cookie-name)
               (string-occurs-p session-cookie-name query-string)))))

(defun verify-plain-request-session (request acceptor constructors)
  "Set REQUEST's session and HUNCHENTOOT:*SESSION* as Hunchentoot's
initializer does, with its handling of an error (logged, 400)."
  (handler-case
      (with-hunchentoot-debugger
        (when (or (not (object-constructors-cookie-only-session-verify-p constructors))
                  (may-name-session-p (hunchentoot:session-cookie-name acceptor)
                                      (cdr (assoc :cookie (hunchentoot:headers-in request)))
                                      (hunchentoot:query-string request)))
          (let ((session (hunchentoot:session-verify request)))
            (setf (hunchentoot:session request) session
                  hunchentoot:*session* session))))
    (error (condition)
      (hunchentoot:log-message* :error "Error when creating REQUEST object: ~A" condition)
      (setf (hunchentoot:return-code*) hunchentoot:+http-bad-request+))))

(defun make-plain-request (constructors acceptor headers content-stream method uri protocol
                           remote-addr remote-port local-addr local-port)
  "The request for the head with HEADERS, METHOD, URI and PROTOCOL, made
without Hunchentoot's initializer, or NIL when it needs that initializer."
  (let ((constructor (object-constructors-plain-request constructors)))
    (when constructor
      (multiple-value-bind (script-name query-string) (plain-request-target uri headers (object-constructors-plus-is-space-p constructors))
        (when script-name
          (let ((request (funcall constructor
                                  acceptor local-addr local-port remote-addr remote-port headers
                                  content-stream method uri protocol
                                  script-name query-string
                                  (if query-string :unparsed '())
                                  (request-cookies headers))))
            (verify-plain-request-session request acceptor constructors)
            request))))))

;;; Any request.

(defun headers-for-request-initializer (headers)
  "HEADERS as Hunchentoot's request initializer may see them without
interning a keyword from a client's string: it makes a keyword of a text/*
Content-Type's charset to look its external format up.  A charset that
names no keyword yet names no external format either, and the initializer
would ignore it with a warning; here it is left out, Content-Type with it,
with the same warning, and the request is decoded as UTF-8 as before."
  (let* ((content-type (cdr (assoc :content-type headers)))
         (charset (and content-type (ignore-errors (content-type-charset content-type)))))
    (if (or (null charset) (find-symbol (string-upcase charset) :keyword))
        headers
        (progn (warn "Invalid character set ~S in request has been ignored." charset)
               (remove :content-type headers :key #'car)))))

(defun make-request (constructors acceptor head addresses content-stream)
  "The request object, of ACCEPTOR's request class (CONSTRUCTORS make it),
for the request whose REQUEST-HEAD is HEAD, on a connection with ADDRESSES
(peer address and port, then ours), whose body is read from
CONTENT-STREAM: made without Hunchentoot's initializer when it can be (see
MAKE-PLAIN-REQUEST), else through it.  Its headers are the client's,
whatever the initializer was shown."
  (let ((remote-addr (first addresses))
        (remote-port (second addresses))
        (local-addr (third addresses))
        (local-port (fourth addresses))
        (headers (request-head-headers head))
        (method (request-head-method head))
        (uri (request-head-uri head))
        (protocol (request-head-protocol head)))
    (or (make-plain-request constructors acceptor headers content-stream method uri protocol
                            remote-addr remote-port local-addr local-port)
        (let* ((initializer-headers (headers-for-request-initializer headers))
               (request (funcall (object-constructors-request constructors)
                                 acceptor local-addr local-port remote-addr remote-port
                                 initializer-headers content-stream method uri protocol)))
          (unless (eq initializer-headers headers)
            (setf (request-headers-in request) headers))
          request))))

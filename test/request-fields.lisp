;;;; The request object's fields -- script name, query string, GET and POST
;;;; parameters, cookies, session, return code -- as a handler sees them,
;;;; compared with what Hunchentoot's own EASY-ACCEPTOR shows the same
;;;; handler for the same request.  The engine makes most requests without
;;;; Hunchentoot's initializer and parses GET parameters and cookies on
;;;; first use; these requests cover what it must hand back to that
;;;; initializer (escapes, charsets, absolute-form targets, user classes).

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite request-fields :in all
  :description "Request fields, the same as Hunchentoot's initializer computes.")
(in-suite request-fields)

(defclass request-with-slots (parallel-request)
  ((tag :initform (list :fresh) :reader request-tag)
   (unbound-slot :reader request-unbound-slot))
  (:documentation "A request class of a user's, initialized as Hunchentoot's
request is, inheriting from PARALLEL-REQUEST as README advises."))

(defclass request-with-default-initargs (parallel-request)
  ((tag :initarg :tag :initform :fresh :reader request-tag))
  (:default-initargs :tag (list :default-initarg))
  (:documentation "A request class of a user's whose slot a default initarg
fills, made without Hunchentoot's initializer all the same."))

(defclass hunchentoot-request-with-slots (ht:request)
  ((tag :initform (list :fresh) :reader request-tag))
  (:documentation "A request class of a user's that inherits only from
Hunchentoot's: served by Hunchentoot's own initializer and PROCESS-REQUEST."))

(defclass request-with-initializer (ht:request)
  ((tag :initform :fresh :reader request-tag))
  (:documentation "A request class of a user's with an initializer of its own."))

(defmethod initialize-instance :after ((request request-with-initializer) &key)
  (setf (slot-value request 'tag) (list :initialized (ht:script-name request))))

(defclass request-with-session-verify (ht:request)
  ((tag :initform nil :accessor request-tag))
  (:documentation "A request class of a user's with sessions of its own."))

(defmethod ht:session-verify ((request request-with-session-verify))
  (setf (request-tag request) (list :verified (ht:header-in :x-session request)))
  nil)

(defun request-fields ()
  "What the current request shows a handler, printed readably."
  (let ((request ht:*request*)
        (*print-pretty* nil))
    (prin1-to-string
     (list :method (ht:request-method* request)
           :protocol (ht:server-protocol* request)
           :host (ht:host request)
           :script-name (ht:script-name* request)
           :query-string (ht:query-string* request)
           :get-parameters (ht:get-parameters* request)
           :post-parameters (ht:post-parameters* request)
           :cookies (ht:cookies-in* request)
           :get-parameter (ht:get-parameter "x" request)
           :cookie (ht:cookie-in "a" request)
           :return-code (ht:return-code*)
           :session (and ht:*session* (eq ht:*session* (ht:session request)))
           :uri (ht:request-uri* request)
           :headers (ht:headers-in* request)
           :class (let ((class (ht:acceptor-request-class ht:*acceptor*)))
                    (if (typep request class) class (type-of request)))
           :tag (and (slot-exists-p request 'tag) (slot-value request 'tag))
           :unbound (and (slot-exists-p request 'unbound-slot) (slot-boundp request 'unbound-slot))))))

(ht:define-easy-handler (test-fields :uri (lambda (request)
                                            (eql 0 (search "/test/fields" (ht:script-name request)))))
    ()
  (setf (ht:content-type*) "text/plain; charset=utf-8")
  (when (ht:get-parameter "start-session")
    (ht:start-session))
  (request-fields))

(defun form-request (body &optional (content-type "application/x-www-form-urlencoded"))
  "A POST to /test/fields with the form BODY, Latin-1, of CONTENT-TYPE."
  (concatenate 'string
               (crlf-lines "POST /test/fields?x=get HTTP/1.1" "Host: localhost"
                           (format nil "Content-Type: ~A" content-type)
                           (format nil "Content-Length: ~D" (length body)) "")
               body))

;;; Session ids in these requests name no session: sessions are shared by
;;; every acceptor in the image, and a real id with a wrong string would be
;;; removed by whichever acceptor saw it first.
(defparameter *field-requests*
  (list (get-request "/test/fields")
        (get-request "/test/fields/a+b/c")
        (get-request "/test/fields/a%20b%2Fc")
        (get-request "/test/fields/caf%C3%A9")
        (get-request "/test/fields/%zz")
        (get-request "/test/fields?x=1&y=2&x=3")
        (get-request "/test/fields?q=a+b&empty=&=v&novalue&x")
        (get-request "/test/fields?")
        (get-request "/test/fields?x=%E3%81%82")
        (get-request "/test/fields?x=%zz")
        (get-request "/test/fields?x=%E9" "Content-Type: text/plain; charset=latin-1")
        (get-request "/test/fields?x=1" "Content-Type: text/plain; Charset=UTF-8")
        (get-request "/test/fields?x=1" "Content-Type: application/json")
        (crlf-lines "GET http://localhost/test/fields?x=abs HTTP/1.1" "Host: localhost" "")
        (crlf-lines "GET https://localhost/test/fields HTTP/1.1" "Host: localhost" "")
        (get-request "/test/fields" "Cookie: a=b; c = d, e=f;g")
        (get-request "/test/fields" "Cookie: a=1" "Cookie: a=2")
        (get-request "/test/fields?x=1" "Cookie: hunchentoot-session=garbage")
        (get-request "/test/fields" "Cookie: hunchentoot-session=987654321%3Aab%zz")
        (get-request "/test/fields?hunchentoot-session=987654321:no-such-session")
        (get-request "/test/fields?hunchentoot+session=987654321:x&%20hunchentoot-session=987654322:y")
        (form-request "x=post&y=%41")
        ;; Read by FORM-FIELDS, and left by it to Hunchentoot's reading.
        (form-request "a=1&b=+x+&c& n = v &d=e=f&&")
        (form-request "&a=1")
        (form-request "a=1&&b=2")
        (form-request (format nil "a=caf~C" (code-char 233)))
        (form-request "e=ada%40example.org&m=a%2C+b%25%00")
        (form-request "a=%E9&b=%C3%A9")
        (form-request "a=%zz")
        (form-request "a=%u0041")
        (form-request "=v&a=")
        (form-request "")
        (form-request "a=1" "application/x-www-form-urlencoded; charset=utf-8")
        (form-request "a=1" "Application/X-WWW-Form-Urlencoded")))

(test request-fields.same-as-hunchentoot
  (check-same-replies *field-requests*))

(test request-fields.user-request-classes-same-as-hunchentoot
  (dolist (class '(request-with-slots request-with-default-initargs hunchentoot-request-with-slots
                   request-with-initializer request-with-session-verify))
    (check-same-replies (list (get-request "/test/fields?x=1" "Cookie: a=b" "X-Session: s1")
                              (get-request "/test/fields/%41" "X-Session: s2"))
                        :request-class class)))

(defun session-cookie-of (reply)
  "The value of the session cookie REPLY sets, or NIL when it sets none."
  (let ((match (nth-value 1 (cl-ppcre:scan-to-strings "(?m)^Set-Cookie: hunchentoot-session=([^;\\r]*)" reply))))
    (and match (aref match 0))))

(defun session-found-p (server &rest headers-and-query)
  "True when SERVER's handler finds a session for a request with the query
string and headers in HEADERS-AND-QUERY (the first, a query string or NIL)."
  (with-connection (socket server)
    (send-text socket (apply #'get-request (format nil "/test/fields~@[?~A~]" (first headers-and-query))
                             (rest headers-and-query)))
    (search "SESSION T" (read-whole-reply socket nil))))

(test request-fields.sessions-found-by-cookie-and-by-get-parameter
  (dolist (class '(ht:easy-acceptor parallel-easy-acceptor))
    (with-server (server (make-server class))
      (let ((cookie (with-connection (socket server)
                      (send-text socket (get-request "/test/fields?start-session=1"))
                      (session-cookie-of (read-whole-reply socket nil)))))
        (is-true (session-found-p server nil (format nil "Cookie: hunchentoot-session=~A" cookie))
                 "~A: the session cookie" class)
        (is-true (session-found-p server nil (format nil "Cookie: a=b; hunchentoot-session=~A; c=d" cookie))
                 "~A: the session cookie among others" class)
        (is-true (session-found-p server (format nil "x=1&hunchentoot-session=~A" cookie))
                 "~A: the session as a GET parameter" class)
        (is-false (session-found-p server nil "Cookie: a=b")
                  "~A: no session cookie" class)
        (is-false (session-found-p server "x=1")
                  "~A: no session parameter" class)
        ;; Hunchentoot removes the session a forged session string names (its
        ;; issue #211: anyone can log anyone out); ours leaves it alone.
        (let ((forged (format nil "~A:forged" (subseq cookie 0 (position #\% cookie)))))
          (with-connection (socket server)
            (send-text socket (get-request "/test/fields" (format nil "Cookie: hunchentoot-session=~A" forged)))
            (let ((set-cookie (session-cookie-of (read-whole-reply socket nil))))
              (if (eq class 'ht:easy-acceptor)
                  (is (equal "deleted" set-cookie) "~A: a forged session string deletes the cookie" class)
                  (is (null set-cookie) "~A: a forged session string set the cookie ~S" class set-cookie)))))
        (if (eq class 'ht:easy-acceptor)
            (is-false (session-found-p server nil (format nil "Cookie: hunchentoot-session=~A" cookie))
                      "~A: the session a forged string named is gone" class)
            (is-true (session-found-p server nil (format nil "Cookie: hunchentoot-session=~A" cookie))
                     "~A: the session a forged string named is gone" class))))))

(test request-fields.classes-made-without-initializer
  (is-true (hunchentoot-recycling-taskmaster::initialized-as-hunchentoot-request-p
            (find-class 'parallel-request)))
  (is-false (hunchentoot-recycling-taskmaster::initialized-as-hunchentoot-request-p
             (find-class 'hunchentoot-request-with-slots))
            "a class that is not a PARALLEL-REQUEST goes through MAKE-INSTANCE")
  (is-true (hunchentoot-recycling-taskmaster::initialized-as-hunchentoot-request-p
            (find-class 'request-with-slots)))
  (is-true (hunchentoot-recycling-taskmaster::initialized-as-hunchentoot-request-p
            (find-class 'request-with-default-initargs)))
  (is-true (hunchentoot-recycling-taskmaster::initialized-as-hunchentoot-reply-p
            (find-class 'reply-with-default-initargs)))
  (is-false (hunchentoot-recycling-taskmaster::initialized-as-hunchentoot-reply-p
             (find-class 'test-reply))
            "a reply class with an initializer of its own goes through MAKE-INSTANCE")
  (is-false (hunchentoot-recycling-taskmaster::initialized-as-hunchentoot-request-p
             (find-class 'request-with-initializer))
            "a class with an initializer of its own goes through MAKE-INSTANCE"))

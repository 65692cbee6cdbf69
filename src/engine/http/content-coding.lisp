;;;; Which content coding a reply may get: the codings an Accept-Encoding
;;;; value accepts, weighed as RFC 9110 12.5.3 says, and the media types
;;;; worth coding.  Pure functions of strings.

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter +blanks+ (coerce '(#\Space #\Tab) 'string)
  "The optional whitespace around an Accept-Encoding element and its parts.")

(defparameter *coding-names* '((:gzip "gzip" "x-gzip") (:br "br") (:zstd "zstd"))
  "Each content coding the engine writes, and the names a client may give it.")

(defun coding-weight (element)
  "The coding name (lower case) and weight of one element of an
Accept-Encoding list, \"gzip;q=0.5\": the weight a number from 0 to 1, 1
when none is given; NIL for a malformed element."
  (let* ((semicolon (position #\; element))
         (name (string-downcase (string-trim +blanks+ (subseq element 0 semicolon)))))
    (when (plusp (length name))
      (if (null semicolon)
          (values name 1)
          (let* ((parameter (string-trim +blanks+ (subseq element (1+ semicolon))))
                 (equals (position #\= parameter)))
            (when (and equals (string-equal "q" (string-trim +blanks+ (subseq parameter 0 equals))))
              (let ((value (string-trim +blanks+ (subseq parameter (1+ equals)))))
                ;; qvalue = ( "0" [ "." 0*3DIGIT ] ) / ( "1" [ "." 0*3("0") ] )
                (when (and (<= 1 (length value) 5)
                           (member (char value 0) '(#\0 #\1))
                           (or (= 1 (length value))
                               (and (char= #\. (char value 1))
                                    (every #'digit-char-p (subseq value 2)))))
                  (let ((weight (if (> (length value) 2)
                                    (+ (digit-char-p (char value 0))
                                       (/ (parse-integer value :start 2) (expt 10 (- (length value) 2))))
                                    (digit-char-p (char value 0)))))
                    (when (<= weight 1)
                      (values name weight)))))))))))

(defun accepted-coding (accept-encoding codings)
  "The first of CODINGS (keywords of *CODING-NAMES*, the server's
preference first) that the Accept-Encoding value ACCEPT-ENCODING accepts
with a weight above 0, by its name or by *; NIL when none is, or when
ACCEPT-ENCODING is NIL (no coding asked for)."
  (when accept-encoding
    (let ((weights '()))
      (dolist (element (uiop:split-string accept-encoding :separator ","))
        (multiple-value-bind (name weight) (coding-weight element)
          (when name (push (cons name weight) weights))))
      (find-if (lambda (coding)
                 (let ((named (find-if (lambda (entry) (member (car entry) (cdr (assoc coding *coding-names*))
                                                               :test #'string=))
                                       weights)))
                   (plusp (cdr (or named (assoc "*" weights :test #'string=) '(nil . 0))))))
               codings))))

(defun media-type (content-type)
  "CONTENT-TYPE without its parameters, lower case: \"text/html\"."
  (string-downcase (string-trim +blanks+ (subseq content-type 0 (position #\; content-type)))))

(defun codable-type-p (content-type types)
  "True when CONTENT-TYPE's media type is one of TYPES: each an exact type,
or \"text/*\" for every subtype."
  (and content-type
       (let ((type (media-type content-type)))
         (some (lambda (pattern)
                 (let ((length (length pattern)))
                   (if (and (> length 2) (string= "/*" pattern :start2 (- length 2)))
                       (and (>= (length type) (1- length))
                            (string= pattern type :end1 (1- length) :end2 (1- length)))
                       (string= pattern type))))
               types))))

(defun coded-entity-tag (tag coding)
  "TAG, an entity tag, for the reply coded with CODING (a keyword): the
name of the coding added inside its quotes, so that a cache never mixes
codings, \"abc\" -> \"abc-gzip\", W/\"abc\" -> W/\"abc-gzip\"."
  (let ((suffix (format nil "-~(~A~)" coding)))
    (if (and (> (length tag) 1) (char= #\" (char tag (1- (length tag)))))
        (concatenate 'string (subseq tag 0 (1- (length tag))) suffix "\"")
        (concatenate 'string tag suffix))))
